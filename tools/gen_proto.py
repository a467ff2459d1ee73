#!/usr/bin/env python3
"""Generate dualpath/v1/*_pb2*.py from proto/dualpath/v1/*.proto (run by setup.py and make).

Skips the work when every output is newer than every input, so `make install` stays quick.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "proto"
OUT = ROOT  # protoc writes dualpath/v1/... below this, matching the proto package path


def main() -> int:
    protos = sorted((SRC / "dualpath" / "v1").glob("*.proto"))
    outdir = ROOT / "dualpath" / "v1"
    outdir.mkdir(parents=True, exist_ok=True)
    init = outdir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated from proto/dualpath/v1 by tools/gen_proto.py; do not edit."""\n')
    if not protos:
        return 0
    newest_in = max(p.stat().st_mtime for p in protos)
    outs = list(outdir.glob("*_pb2*.py"))
    if outs and len(outs) >= 2 * len(protos) and min(o.stat().st_mtime for o in outs) > newest_in:
        return 0
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{SRC}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}"] + [str(p) for p in protos]
    rc = protoc.main(args)
    if rc != 0:
        print(f"gen_proto: protoc failed with {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
