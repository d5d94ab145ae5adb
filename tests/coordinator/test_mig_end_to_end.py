"""MIG end to end on a CPU: the agent publishes the fake NVML's MIG instances, the coordinator grants by profile,
``gpupool status`` shows the slices and who holds them."""

from __future__ import annotations

import threading
from pathlib import Path

from testkit import wait_for

from gpupool_sdk.agent.agent import NodeAgent
from gpupool_sdk.cli.output import TableSpec, plain_table
from gpupool_sdk.cli.status_cmd import read_pool, sections, status_dict
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.inventory.nvml import NvmlBackend
from gpupool_sdk.resources import JobSpec, JobState, JobStatus
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from tests.inventory.fake_nvml import FakeNvml, mig_box

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


def _state(store: EtcdStore, job: str) -> JobState | None:
    got = store.get_record(store.keys.job_status(job), JobStatus)
    return got[0].state if got else None


def test_mig_slices_published_granted_by_profile_and_shown(store: EtcdStore, tmp_path: Path) -> None:
    backend = NvmlBackend(node="mig-box", nvml=FakeNvml(mig_box()), sysfs_root=tmp_path)
    agent = NodeAgent(store, backend, TIMING, refresh_interval_s=0.2)
    agent.start()
    coord = Coordinator(store, SchedulerConfig(), TIMING, "mig", loop_wait_s=0.5)
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    leases: list[int] = []
    try:
        wait_for(lambda: coord.is_leader, what="leadership")
        for name, spec in (
            ("on-mig", JobSpec(name="on-mig", qos="exclusive", mig_profile="3g.40gb", node="mig-box")),
            ("plain", JobSpec(name="plain", memory="8GiB", compute_share=0.5, node="mig-box")),
            ("absent", JobSpec(name="absent", memory="4GiB", mig_profile="1g.10gb", node="mig-box")),
        ):
            lease = store.grant_lease(30)
            leases.append(lease)
            store.create(store.keys.job_spec(name), spec, lease=lease)
        wait_for(lambda: _state(store, "on-mig") is JobState.GRANTED and _state(store, "plain") is JobState.GRANTED,
                 what="both grants")
        wait_for(lambda: _state(store, "absent") is JobState.REJECTED, what="the job asking a profile nobody has")
        d = status_dict(read_pool(store))
        gpus = {g["uuid"]: g for g in d["gpus"]}
        assert set(gpus) == {"MIG-fake-0000-1", "MIG-fake-0000-2", "GPU-fake-0001-aaaa-bbbb"}
        mig_jobs = gpus["MIG-fake-0000-1"]["jobs"] + gpus["MIG-fake-0000-2"]["jobs"]
        assert mig_jobs == ["on-mig"] and gpus["GPU-fake-0001-aaaa-bbbb"]["jobs"] == ["plain"]
        assert gpus["MIG-fake-0000-1"]["mig_profile"] == "3g.40gb"
        assert gpus["MIG-fake-0000-1"]["mig_parent"] == "GPU-fake-0000-aaaa-bbbb"
        # One job per GPU: the MIG instances are isolated by the hardware, the whole GPU shares nothing.
        assert [gpus[u]["sharing"] for u in sorted(gpus)] == ["none", "mig", "mig"]
        text = "\n".join(plain_table(p) for p in sections(read_pool(store), store.endpoint) if isinstance(p, TableSpec))
        assert "A100-80GB MIG 3g.40gb" in text and "SHARING" in text
    finally:
        for lease in leases:
            store.revoke_lease(lease)
        coord.stop()
        t.join(20)
        agent.stop()
        backend.close()
