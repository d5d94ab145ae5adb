#!/usr/bin/env bash
# The prepared GPU check run, for a session that is lent a GPU machine (see docs/gpu.md).
# Runs every test marked `gpu` (NVML inventory, NVML sampler, CUDA allocator in replace mode,
# CuPy + torch shared quota, balloon round trip on a real GPU, MIG read through NVML, MPS limits, the
# runtime's MPS environment applied before/after CUDA starts and two runtimes time-slicing one GPU 0.7/0.3:
# tests/runtime/test_sharing_gpu.py; the agent's usage readings: tests/inventory/test_nvml.py),
# the NVML usage-read check (benchmarks/bench_nvml_usage.py) and the allocator benchmark
# against PyTorch's own caching allocator, and writes the results under ${OUT:-gpu-results}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
{
  nvidia-smi || true
  nvidia-smi topo -m || true
} >"$out/nvidia-smi.txt" 2>&1
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install --quiet torch -e ".[server,test,cuda]" >"$out/pip.log" 2>&1 || pip install --quiet torch -e ".[server,test]" >>"$out/pip.log" 2>&1
pip install --quiet -e integrations/torch -e integrations/lightning >>"$out/pip.log" 2>&1
# Core GPU tests, then the torch adapter's (replace mode, allocator="gpupool" install + balloon, CuPy).
python -m pytest -m gpu -v -s -p no:cacheprovider tests integrations/torch/tests integrations/lightning/tests \
  >"$out/pytest-gpu.txt" 2>&1
# MIG state through NVML (tests/inventory/test_mig.py reads it too) and the MPS limits check
# (tests/client/test_mps.py: a real MPS control daemon, the grant's pinned-memory limit enforced).
python -c "import json, pynvml; pynvml.nvmlInit(); from gpupool_sdk.inventory import mig_admin; print(json.dumps([s.to_dict() for s in mig_admin.list_gpus(pynvml)], indent=2))" >"$out/mig-list.json" 2>&1
which nvidia-cuda-mps-control >"$out/mps.txt" 2>&1
echo "pytest rc=$?" >>"$out/pytest-gpu.txt"
# The agent's per-refresh usage reads (utilisation, memory, PCIe/NVLink counters): call cost, supported
# fields, and PCIe units checked against host-to-device copies of a known size (docs/inventory.md).
timeout 120 python benchmarks/bench_nvml_usage.py --json >"$out/nvml_usage.json" 2>"$out/nvml_usage.err"
timeout 300 python benchmarks/bench_allocator.py --json >"$out/bench_allocator.json" 2>"$out/bench_allocator.err"
echo "done; results in $out"
