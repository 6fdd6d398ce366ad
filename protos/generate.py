"""Generate the Python stubs of protos/ into common/v1 (`make protos`; a test checks the
committed ones match).

protoc names a generated module by its .proto path (pagedserve/v1/x.proto ->
`pagedserve.v1.x_pb2`), so its imports of sibling stubs read `from pagedserve.v1 import ...`.
The stubs live in the `common` package instead (the bottom layer, shared by the frontend
and the engine; docs/architecture.md), so those imports are made relative and the
messages' `__module__` names common.v1. The wire names
(package `pagedserve.v1`, services such as `pagedserve.v1.Generation`) and the descriptors'
file names are protoc's, unchanged.

    python protos/generate.py [OUT_DIR]     # default: common/v1
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
PACKAGE = "pagedserve/v1"  # the protos' folder, and so protoc's module path
OUT = ROOT / "common" / "v1"


def generate() -> dict[str, str]:
    """{file name: text} of every stub, imports made relative."""
    from grpc_tools import protoc
    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / PACKAGE).glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTOS}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        made = sorted((Path(tmp) / PACKAGE).glob("*.py*"))
        return {p.name: _relocated(p.read_text()) for p in made}


def _relocated(text: str) -> str:
    """Sibling imports made relative, and the messages' `__module__` where they now live."""
    return (text.replace("from pagedserve.v1 import ", "from . import ")
            .replace("(DESCRIPTOR, 'pagedserve.v1.", "(DESCRIPTOR, 'common.v1."))


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    out.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (out / name).write_text(text)
    print(f"wrote the stubs of {PROTOS / PACKAGE} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
