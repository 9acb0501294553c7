#!/usr/bin/env bash
# GPU check for decide's cuda backend: build, parity suite on the GPU, then the GPU benchmark.
# Meant for a machine with an NVIDIA GPU and driver; finishes in well under 5 minutes.
#
# Usage (from anywhere): bench/gpu_check.sh
#   KVLEDGER_TRACE=/path/to/mooncake_synthetic_trace.jsonl  the benchmark's trace (default:
#       ../shared/data/ beside the checkout, where the project keeps it; never in the repo)
#   KVLEDGER_PYTHON_READY=1   use the current python as it is: kvledger's dependencies are
#       already importable (a machine with no package index, say) and the checkout is on PYTHONPATH
#   PYTHON=python3.12   the interpreter for a new environment
# Otherwise uses .venv when it exists, or creates .venv-gpu and installs kvledger with its
# test and bench extras (that needs the package index, or wheels already in pip's cache).
# Every step runs even when one before it failed, so one run shows everything that fails;
# the exit status is 1 when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PY=python
if [ "${KVLEDGER_PYTHON_READY:-0}" = 1 ]; then
  PY=$PYTHON
elif [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
else
  if [ ! -x .venv-gpu/bin/python ]; then "$PYTHON" -m venv .venv-gpu; fi
  . .venv-gpu/bin/activate
  python -m pip install -q -e '.[test,bench]' || { echo "FAIL: could not install kvledger" >&2; exit 1; }
fi
TRACE=${KVLEDGER_TRACE:-$(cd .. && pwd)/shared/data/mooncake_synthetic_trace.jsonl}
if [ ! -f "$TRACE" ]; then
  echo "FAIL: no trace at $TRACE (set KVLEDGER_TRACE to the Mooncake trace)" >&2
  exit 1
fi
failed=()
step() {  # step NAME COMMAND...: run one step, note it when it fails, go on
  local name=$1
  shift
  echo "== $name"
  "$@" || { echo "FAIL: $name (exit $?)"; failed+=("$name"); }
}

echo "== device"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv || true
"$PY" - <<'PY' || exit 1
from kvledger.decide.ranking.cuda import compile_source, device_unavailable_reason, kernel_sources

reason = device_unavailable_reason()
if reason is not None:
    # cuda-python 13 (what kvledger installs) needs an NVIDIA driver of the 580 series or newer.
    raise SystemExit(f"FAIL: no usable CUDA device: {reason}")
import importlib.metadata as metadata

from cuda.bindings import driver, nvrtc
from cuda.core import Device

device = Device(0)
arch = "sm_%d%d" % device.compute_capability
print("cuda.core", metadata.version("cuda-core"), "cuda-bindings", metadata.version("cuda-bindings"),
      "sees", device.name, arch, "; driver API", driver.cuDriverGetVersion()[1], "; NVRTC", nvrtc.nvrtcVersion()[1:])
for name, source in kernel_sources().items():
    compile_source(source, arch)  # raises on any error or warning
    print(f"NVRTC compiled {name} for {arch} with no warnings")
PY
step "build: NVRTC compiles every kernel for sm_80 and sm_90 (as CI does)" \
  timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_decide_nvrtc.py
step "compiled CPU kernels (numba; both backends share them): compiled once, then cached" \
  timeout 180 "$PY" -c "from kvledger.decide.ranking.cpu import compile_kernels; from kvledger.core.settings import ReuseSettings; compile_kernels(ReuseSettings())"
parity() {
  timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_decide_parity.py \
    tests/test_decide_service.py::test_auto_picks_cuda_only_when_a_device_answers_and_says_which \
    tests/test_decide_service.py::test_a_cuda_backend_that_cannot_start_says_why_at_startup \
    | tee /tmp/kvledger-gpu-parity.txt
  local status=$?
  if grep -q "SKIPPED.*cuda" /tmp/kvledger-gpu-parity.txt; then echo "cuda tests were skipped"; return 1; fi
  return $status
}
step "parity suite and the cuda startup tests (cuda must run, not skip)" parity
bench() {
  DYN_LOG=error timeout 240 "$PY" bench/decide.py --trace "$TRACE" --backends cpu,cuda --workers 64 \
    --gpu-workers 256 --batch 1024 --repeats "${KVLEDGER_GPU_REPEATS:-3}" --no-service --gpu-profile 2>&1 \
    | grep -v ' WARN '
}
step "benchmark (cpu, and Dynamo where installed, at 64 workers; cuda beside cpu at 64 and 256 workers)" bench
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu check passed"
