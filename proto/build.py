"""Generate Python gRPC code for proto/gemrec/v1/*.proto into the same folder.

protoc names imports after the proto path (`from gemrec.v1 import x_pb2`); our package lives at
`gemrec.proto.gemrec.v1`, so those imports are rewritten after generation.
"""

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "gemrec" / "v1"
IMPORT_RE = re.compile(r"^from gemrec\.v1 import", re.MULTILINE)


def generate() -> list[Path]:
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    if not protos:
        return []
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={PROTO_ROOT}",
        f"--pyi_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {', '.join(p.name for p in protos)}")
    generated = sorted(PACKAGE_DIR.glob("*_pb2*.py*"))
    for path in generated:
        text = path.read_text()
        path.write_text(IMPORT_RE.sub("from gemrec.proto.gemrec.v1 import", text))
    return generated


if __name__ == "__main__":
    for path in generate():
        print(f"generated {path.relative_to(PROTO_ROOT.parent)}", file=sys.stderr)
