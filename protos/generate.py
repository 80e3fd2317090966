"""Regenerates the Python stubs of every ``.proto`` under ``protos/`` (run from anywhere).

    python -m protos.generate            # rewrite the stubs in place
    python -m protos.generate --check    # exit 1 when the committed stubs are stale

Stubs are generated with ``-I <repo root>``, so they import as ``protos.tandem.v1...``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTOS.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of every proto file under ``out_dir``; returns their paths.

    protoc runs in a process of its own: loaded into a process that has loaded UCX
    (the nixl backend) it crashed.
    """
    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", *files]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}\n{done.stderr}")
    stems = [out_dir / f.removesuffix(".proto") for f in files]
    return [Path(f"{s}{suffix}") for s in stems for suffix in ("_pb2.py", "_pb2_grpc.py")]


def stale_stubs() -> list[str]:
    """Stub files that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for f in fresh:
            committed = ROOT / f.relative_to(tmp)
            if not committed.is_file() or committed.read_text() != f.read_text():
                stale.append(str(committed.relative_to(ROOT)))
        return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        for s in stale:
            print(f"stale: {s}", file=sys.stderr)
        return 1 if stale else 0
    for f in generate(ROOT):
        print(f"wrote {f.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
