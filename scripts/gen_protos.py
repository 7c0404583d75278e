"""Generate the Python gRPC stubs for protos/trainyard/v1 into trainyard/v1 (committed, so importing needs no step).

Run after editing a .proto:  python scripts/gen_protos.py
tests/services/common/test_common_basics.py fails when the committed stubs are stale.
"""
from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PROTO_DIR.glob("trainyard/v1/*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "trainyard" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    sys.exit(0)
