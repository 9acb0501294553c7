"""The kvledger service image for the container lane, built once per test session.

Built from docker/Dockerfile in this checkout, on the base KVLEDGER_PYTHON_IMAGE names
(python:3.11-slim unless CI points it at its stand-in), and tagged kvledger:test, which the
compose tests run as KVLEDGER_TAG=test. Docker's layer cache makes a rebuild of an
unchanged checkout take a second or two.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TAG = "test"
IMAGE = f"kvledger:{TAG}"
PYTHON_IMAGE_VARIABLE = "KVLEDGER_PYTHON_IMAGE"
BUILD_TIMEOUT_S = 900


@dataclass(frozen=True)
class BuiltImage:
    name: str
    build_seconds: float


def python_image(environ: os._Environ[str] | dict[str, str]) -> str:
    return environ.get(PYTHON_IMAGE_VARIABLE, "").strip() or "python:3.11-slim"


@functools.cache
def kvledger_image() -> BuiltImage:
    """Build (or find in Docker's layer cache) the service image; the build's log tail on failure."""
    started = time.monotonic()
    command = ["docker", "build", "-f", "docker/Dockerfile", "-t", IMAGE,
               "--build-arg", f"PYTHON_IMAGE={python_image(os.environ)}", "."]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise RuntimeError(f"docker build exited with {result.returncode}:\n{tail}")
    return BuiltImage(IMAGE, time.monotonic() - started)
