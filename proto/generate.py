"""Regenerate the Python code of the wire protocol, or check that it is up to date.

    python proto/generate.py           # rewrite proto/streamengine/{v1,etcd}/*_pb2*.py(i)
    python proto/generate.py --check   # exit 1 if regenerating would change anything

Two packages: `streamengine.v1`, our protocol, and `streamengine.etcd`, etcd's v3 API
(metadata and master election), from the protos `proto/etcd_protos.py` copies out of
Debian's etcd.

The generated modules are committed (so a plain `pip install` needs no protoc) and are
stamped with the grpcio-tools version; pyproject pins that version for development and
requires at least it at run time.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGES = ("v1", "etcd")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate_into(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: imported only when generating

    # protoc finds the mypy plugins (protoc-gen-mypy*) on PATH; they sit beside python.
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    protos = sorted(
        str(p.relative_to(PROTO_ROOT))
        for package in PACKAGES
        for p in (PROTO_ROOT / "streamengine" / package).glob("*.proto")
    )
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(root: Path) -> dict[str, Path]:
    """Generated modules by their path under `streamengine/`, e.g. `v1/entry_pb2.py`."""
    found = {}
    for package in PACKAGES:
        for path in (root / "streamengine" / package).glob("*"):
            if path.name.endswith(GENERATED_SUFFIXES):
                found[f"{package}/{path.name}"] = path
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate_into(out)
        fresh = generated_files(out)
        current = generated_files(PROTO_ROOT)
        if args.check:
            stale = sorted(
                name
                for name in fresh.keys() | current.keys()
                if name not in fresh
                or name not in current
                or not filecmp.cmp(fresh[name], current[name], shallow=False)
            )
            if stale:
                print(f"generated code is stale, run `make proto`: {', '.join(stale)}")
                return 1
            print(f"generated code is up to date ({len(fresh)} files)")
            return 0
        for stale_path in current.values():
            stale_path.unlink()
        for name, path in fresh.items():
            shutil.copyfile(path, PROTO_ROOT / "streamengine" / name)
        print(f"wrote {len(fresh)} files into proto/streamengine/{{{','.join(PACKAGES)}}}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
