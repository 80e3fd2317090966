"""What ``scripts/gpu-check`` runs loads on the GPU image, which has no serving stack.

The image's packages are listed in ``tests/gpu/image-packages.txt``;
``tests/gpu/image_only.py`` makes a fresh interpreter refuse every other installed
package. Under it, these tests check that the refusal works, that every module
``bench.gpu`` and the GPU tests import (at module level or inside functions) loads, and
that ``tests/gpu`` collects and passes on CPU (Triton's interpreter): a module-level
``import gguf`` or ``import ray`` on that path fails here rather than first on a lent GPU.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Needs ray, which the image lacks: its tests skip there, saying so, and its imports
# (kv_transfer.peer, the CPU conformance suite) are the CPU suite's.
NEEDS_RAY = {"tests/gpu/test_gpu_transfer.py"}
# bench/gpu.py and its measurements' modules (bench/gpu_kernels.py, bench/gpu_engine.py), and the GPU tests.
GPU_PATH = [*sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").glob("gpu*.py")),
            *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/gpu").glob("*.py"))]


def _image_python(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``python -m tests.gpu.image_only ARGS`` in the repository, on CPU."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "TANDEM_TEST_DEVICE": "cpu", **env}
    return subprocess.run(
        [sys.executable, "-m", "tests.gpu.image_only", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _imported_modules(path: Path) -> set[str]:
    """Every absolute module ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.add(node.module)
    return names


def _output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def test_the_image_refuses_what_it_lacks_and_imports_what_it_has():
    check = (
        "import importlib.util\n"
        "for name in ('ray', 'gguf', 'fastapi', 'xgrammar', 'grpc', 'hypothesis'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(f'{name} imported')\n"
        "import torch, triton, transformers, safetensors, tokenizers, jinja2, numpy, pytest\n"
        "import prometheus_client, huggingface_hub, engine\n"
        "print('ok')\n"
    )
    proc = _image_python("-c", check)
    assert proc.returncode == 0 and "ok" in proc.stdout, _output(proc)


def test_every_module_bench_gpu_and_the_gpu_tests_import_loads_on_the_image():
    modules = sorted(set().union(*(_imported_modules(ROOT / p) for p in GPU_PATH if p not in NEEDS_RAY)))
    assert "engine.model.triton_attention" in modules and "transformers" in modules, modules
    proc = _image_python("-c", "\n".join(f"import {m}" for m in modules))
    assert proc.returncode == 0, f"importing {modules} with only the GPU image's packages:\n" + _output(proc)


def test_missing_gguf_is_reported_by_name_when_a_gguf_file_is_opened(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    check = (
        "from engine.model.gguf_checkpoint import open_gguf\n"
        f"open_gguf({str(path)!r})\n"
    )
    proc = _image_python("-c", check)
    assert proc.returncode != 0
    assert "reading GGUF files needs the 'gguf' package (pip install gguf)" in proc.stderr, _output(proc)


def test_gpu_tests_collect_and_pass_on_cpu_with_only_the_image_packages():
    proc = _image_python(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", "tests/gpu",
        timeout=900, TRITON_INTERPRET="1",
    )  # fmt: skip
    assert proc.returncode == 0, "tests/gpu on CPU, GPU image packages only:\n" + _output(proc)
    assert " passed" in proc.stdout and " failed" not in proc.stdout, _output(proc)
