"""What ``scripts/gpu-check`` checks before any test, so a machine that cannot run the
kernels fails in seconds with its reason rather than as every kernel test failing.

* the packages the checks import (``tests/gpu/image-packages.txt`` lists the image's);
* torch sees the device (``TANDEM_TEST_DEVICE=cuda``) or runs on CPU;
* a C compiler and ``Python.h``: Triton compiles a small launcher module per kernel
  signature at run time, found as Triton finds them (``$CC``, else gcc, else clang; the
  include folder of the interpreter's install scheme);
* one one-element Triton kernel compiled and launched, its result read back.

    python -m tests.gpu.preflight [--json FILE]

Exit status 1 names the first thing missing; ``--json`` writes every check either way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

IMPORTS = ("torch", "triton", "transformers", "safetensors", "tokenizers", "jinja2", "numpy",
           "pytest", "prometheus_client")  # fmt: skip


class PreflightError(RuntimeError):
    """A check that failed, with what to do about it."""


def versions() -> dict[str, str]:
    """Each package's version; PreflightError naming every one that does not import."""
    found, missing = {"python": sys.version.split()[0]}, []
    for name in IMPORTS:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        raise PreflightError("cannot import " + ", ".join(missing) + " (bring wheels with --carry)")
    return found


def c_compiler(env: dict[str, str] | None = None) -> str:
    """The C compiler Triton will run: ``$CC``, else gcc, else clang."""
    env = os.environ if env is None else env
    cc = env.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise PreflightError("no C compiler (CC unset, no gcc or clang on PATH): Triton builds "
                             "each kernel's launcher with one")  # fmt: skip
    return cc


def python_include() -> Path:
    """The folder that must hold ``Python.h``, as Triton's build looks it up."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # Debian's, as Triton does
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def check_python_extension_builds(cc: str, include: Path) -> None:
    """Compile a stub that includes ``Python.h`` into a shared object, as Triton does."""
    if not (include / "Python.h").is_file():
        raise PreflightError(f"no Python.h in {include} (the python3-dev package): Triton "
                             "compiles each kernel's launcher against it")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tandem-preflight-") as tmp:
        src = Path(tmp, "stub.c")
        src.write_text("#include <Python.h>\nint tandem_stub(void) { return Py_IsInitialized(); }\n")
        cmd = [cc, str(src), "-O1", "-shared", "-fPIC", f"-I{include}", "-o", str(Path(tmp, "stub.so"))]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except OSError as e:
            raise PreflightError(f"cannot run the C compiler {cc!r}: {e}") from e
        if proc.returncode != 0:
            raise PreflightError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def launch_one_element_kernel(device: str) -> float:
    """Compile (or, on CPU, interpret) and launch a kernel that writes 1 + 41; returns the
    seconds it took, first compile included."""
    import time

    import torch

    from tests.gpu.one_element import add_one

    t0 = time.perf_counter()
    x = torch.full((1,), 41.0, device=device)
    add_one[(1,)](x)
    got = float(x.item())
    if got != 42.0:
        raise PreflightError(f"a one-element Triton kernel on {device} wrote {got}, not 42.0")
    return time.perf_counter() - t0


def run_checks() -> dict:
    """Every check in order; stops at the first failure, recorded under "error"."""
    result: dict = {"ok": False}
    try:
        result["versions"] = versions()
        import torch

        from tests.gpu.device import DEVICE  # sets TRITON_INTERPRET on CPU, before triton runs

        result["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
        result["cuda"] = torch.version.cuda
        result["c_compiler"] = c_compiler()
        result["python_include"] = str(python_include())
        check_python_extension_builds(result["c_compiler"], python_include())
        result["triton_kernel_s"] = round(launch_one_element_kernel(DEVICE), 3)
        result["ok"] = True
    except (PreflightError, RuntimeError) as e:  # device.py raises RuntimeError without CUDA
        result["error"] = str(e)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.preflight", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the checks' results here")
    args = ap.parse_args(argv)
    result = run_checks()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"preflight: {key}: {value}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
