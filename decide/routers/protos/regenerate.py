"""Regenerate the Python modules beside the .proto files: `python -m kvledger.decide.routers.protos.regenerate`.

Needs grpcio-tools (generation only; the service needs grpcio and protobuf). The .proto files
are the routers' own, unchanged, so their descriptors keep the names the routers use.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("kv_indexer.proto", "indexer.proto")


def main() -> int:
    from grpc_tools import protoc  # imported here: only generation needs grpcio-tools

    for proto in PROTOS:
        code = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"--python_out={HERE}", f"--grpc_python_out={HERE}",
                            str(HERE / proto)])
        if code:
            return code
        # protoc writes a top-level import; a relative one keeps the modules inside this package.
        stub = HERE / proto.replace(".proto", "_pb2_grpc.py")
        module = proto.replace(".proto", "_pb2")
        stub.write_text(re.sub(rf"^import {module} as ", f"from . import {module} as ", stub.read_text(), flags=re.M))
    return 0


if __name__ == "__main__":
    sys.exit(main())
