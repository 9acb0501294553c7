#!/usr/bin/env bash
# GPU check for decide's cuda backend: build, parity suite on the GPU, then the GPU benchmark.
# Meant for a machine with an NVIDIA GPU and driver; finishes in well under 5 minutes.
#
# Usage (from anywhere): bench/gpu_check.sh
#   KVLEDGER_TRACE=/path/to/mooncake_synthetic_trace.jsonl  the benchmark's trace (default:
#       ../shared/data/ beside the checkout, where the project keeps it; never in the repo)
#   PYTHON=python3.12   the interpreter for a new environment
# Uses .venv when it exists; otherwise creates .venv-gpu and installs kvledger with its
# test and bench extras (that needs the package index, or wheels already in pip's cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
else
  if [ ! -x .venv-gpu/bin/python ]; then "$PYTHON" -m venv .venv-gpu; fi
  . .venv-gpu/bin/activate
  python -m pip install -q -e '.[test,bench]'
fi
TRACE=${KVLEDGER_TRACE:-$(cd .. && pwd)/shared/data/mooncake_synthetic_trace.jsonl}
if [ ! -f "$TRACE" ]; then
  echo "FAIL: no trace at $TRACE (set KVLEDGER_TRACE to the Mooncake trace)" >&2
  exit 1
fi

echo "== device"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv || true
python - <<'PY'
from decide.cuda import compile_source, device_unavailable_reason, kernel_sources

reason = device_unavailable_reason()
if reason is not None:
    # cuda-python 13 (what kvledger installs) needs an NVIDIA driver of the 580 series or newer.
    raise SystemExit(f"FAIL: no usable CUDA device: {reason}")
from cuda.bindings import nvrtc
from cuda.core import Device

device = Device(0)
arch = "sm_%d%d" % device.compute_capability
print("cuda.core sees", device.name, arch, "; NVRTC", nvrtc.nvrtcVersion()[1:])
for name, source in kernel_sources().items():
    compile_source(source, arch)  # raises on any error or warning
    print(f"NVRTC compiled {name} for {arch} with no warnings")
PY
echo "== build: NVRTC compiles every kernel for sm_80 and sm_90 (as CI does)"
timeout 60 python -m pytest -q tests/test_decide_nvrtc.py
echo "== compiled CPU kernels (numba; both backends share them): compiled once, then cached"
timeout 180 python -c "from decide.cpu import compile_kernels; from kvledger.settings import ReuseSettings; compile_kernels(ReuseSettings())"
echo "== parity suite and the cuda startup tests (cuda must run, not skip)"
set -o pipefail
timeout 150 python -m pytest -q -rs tests/test_decide_parity.py \
  tests/test_decide_service.py::test_auto_picks_cuda_only_when_a_device_answers_and_says_which \
  tests/test_decide_service.py::test_a_cuda_backend_that_cannot_start_says_why_at_startup \
  | tee /tmp/kvledger-gpu-parity.txt
if grep -q "SKIPPED.*cuda" /tmp/kvledger-gpu-parity.txt; then echo "FAIL: cuda tests were skipped"; exit 1; fi
echo "== benchmark (cpu vs Dynamo at 64 workers; cuda at 64 and 256 workers)"
DYN_LOG=error timeout 180 python bench/decide.py --trace "$TRACE" --backends cpu,cuda --workers 64 \
  --gpu-workers 256 --batch 1024 2>&1 | grep -v ' WARN '
