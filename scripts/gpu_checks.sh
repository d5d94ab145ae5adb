#!/usr/bin/env bash
# The prepared GPU check run, for a session that is lent a GPU machine (see docs/gpu.md).
# Runs every test marked `gpu` (NVML inventory, NVML sampler, CUDA allocator in replace mode,
# CuPy + torch shared quota, balloon round trip on a real GPU) and the allocator benchmark
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
python -m pytest -m gpu -v -s -p no:cacheprovider tests >"$out/pytest-gpu.txt" 2>&1
echo "pytest rc=$?" >>"$out/pytest-gpu.txt"
timeout 300 python benchmarks/bench_allocator.py --json >"$out/bench_allocator.json" 2>"$out/bench_allocator.err"
echo "done; results in $out"
