"""The node agent: publishes a node's GPUs under its own etcd lease (see :mod:`.agent`)."""

from gpupool_sdk.agent.agent import NodeAgent, publishable, run_agents, stop_all
from gpupool_sdk.agent.signals import install_stop_handlers

__all__ = ["NodeAgent", "install_stop_handlers", "publishable", "run_agents", "stop_all"]
