#!/usr/bin/env bash
# GPU check for decide's cuda backend: build, parity suite on the GPU, then the GPU benchmark.
# Meant for a machine with an NVIDIA GPU and driver; finishes in well under 5 minutes.
# Usage: bench/gpu_check.sh   (from the repository root; uses .venv when present)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; else python -m pip install -q -e '.[test]'; fi
echo "== device"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv || true
python - <<'PY'
from decide.cuda import device_unavailable_reason
reason = device_unavailable_reason()
if reason is not None:
    raise SystemExit(f"no usable CUDA device: {reason}")
from cuda.core import Device
d = Device(0)
print("cuda.core sees", d.name, "sm_%d%d" % d.compute_capability)
PY
echo "== build: NVRTC compiles every kernel (sm_80, sm_90 and this device's arch)"
timeout 60 python -m pytest -q tests/test_decide_nvrtc.py
echo "== parity suite, cpu and cuda (cuda must run, not skip)"
timeout 120 python -m pytest -q -rs tests/test_decide_parity.py | tee /tmp/kvledger-gpu-parity.txt
if grep -q "SKIPPED.*cuda" /tmp/kvledger-gpu-parity.txt; then echo "FAIL: cuda parity tests were skipped"; exit 1; fi
echo "== benchmark (cpu vs Dynamo at 64 workers; cuda at 64 and 256 workers)"
DYN_LOG=error timeout 150 python bench/decide.py --backends cpu,cuda --workers 64 --gpu-workers 256 --batch 1024 2>&1 | grep -v ' WARN '
