"""Import boundaries: what a process loads when it imports a part of the house.

Each check runs in a fresh interpreter, since this one has torch loaded already.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import router


def _loaded_after(imports: list[str]) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in imports) + "print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


import engine.wire  # noqa: E402

WIRE_MODULES = [f"engine.wire.{m.name}" for m in pkgutil.iter_modules(engine.wire.__path__)]
ROUTER_MODULES = [f"router.{m.name}" for m in pkgutil.iter_modules(router.__path__)] + WIRE_MODULES
WORKER_PACKAGES = ("decode_worker", "prefill_worker", "kv_transfer")


def test_the_router_process_loads_no_torch_and_no_worker_code():
    assert {"router.server", "router.core", "router.dispatch"} <= set(ROUTER_MODULES), ROUTER_MODULES
    loaded = _loaded_after(ROUTER_MODULES)
    assert "torch" not in loaded, "the router must not import torch (move cross-process types to engine.wire.messages)"
    workers = sorted(m for m in loaded if m.split(".")[0] in WORKER_PACKAGES)
    assert not workers, f"the router must not import worker code: {workers}"


def test_imports_point_down_from_the_workers_to_kv_transfer_to_the_engine():
    kv_transfer = ["kv_transfer.base", "kv_transfer.collective", "kv_transfer.object_store", "kv_transfer.inprocess"]
    loaded = _loaded_after(kv_transfer)
    above = sorted(m for m in loaded if m.split(".")[0] in ("decode_worker", "prefill_worker", "router"))
    assert not above, f"kv_transfer must not import the workers or the router: {above}"
    loaded = _loaded_after(["engine.llm_engine", "engine.async_engine"])
    above = sorted(m for m in loaded if m.split(".")[0] in (*WORKER_PACKAGES, "router", "ray"))
    assert not above, f"the engine must import nothing above it, nor Ray: {above}"


def test_the_pools_and_the_workers_import_nothing_of_the_router():
    loaded = _loaded_after(["cluster.pools", "cluster.pool_worker", "cluster.elastic"])
    router = sorted(m for m in loaded if m.split(".")[0] == "router" and m not in ("router", "router.latency"))
    assert not router, f"the pools must not need the router's code: {router}"


@pytest.mark.parametrize(
    "module",
    ["engine.core.scheduler", "engine.core.request_queues", "engine.core.block_pool", "engine.core.block_hash",
     "engine.core.kv_blocks", "engine.core.scheduler_plan", "engine.core.batching", "engine.core.decode_run",
     "engine.core.host_tier",
     "engine.core.step_shape", "engine.model.runner_input", "router.placement", "router.worker_loads", "router.dispatch_config",
     "router.admission", "router.aborts", "router.tool_parsers", "router.json_rewriter", "router.tool_calls", "engine.wire.messages"],
)
def test_pure_parts_import_no_torch_ray_or_network_library(module):
    loaded = _loaded_after([module])
    heavy = sorted(m for m in ("torch", "ray", "grpc", "fastapi", "httpx") if m in loaded)
    assert not heavy, f"{module} must stay pure, but importing it loaded {heavy}"


def test_the_wire_loads_nothing_else_of_the_engine():
    loaded = _loaded_after(WIRE_MODULES)
    assert {"engine.wire.messages", "engine.wire.worker_api", "engine.wire.token_channel"} <= loaded, WIRE_MODULES
    other = sorted(m for m in loaded if m.startswith("engine.") and not m.startswith("engine.wire"))
    assert not other, f"the router takes engine.wire alone; it must not load {other}"


# The engine's rooms, each over the ones after it: a module imports its own room, the
# rooms below it and nothing above (the top level is the engine's facade and text features).
ENGINE_FLOORS = ("engine", "engine.model", "engine.core", "engine.wire")


def _engine_room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else "engine"


def test_the_engines_rooms_import_only_downwards():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    up = []
    for path in sorted((root / "engine").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        floor = ENGINE_FLOORS.index(_engine_room(module))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine."):
                target = node.module
                if target in ("engine.core", "engine.model", "engine.wire"):  # from engine.wire import x
                    target = f"{target}.{node.names[0].name}"
                if ENGINE_FLOORS.index(_engine_room(target)) < floor:
                    up.append(f"{path.relative_to(root)}:{node.lineno} imports {node.module}")
    assert not up, f"imports pointing up the engine's rooms: {up}"


def test_reading_gguf_metadata_and_resolving_model_names_load_no_torch():
    # The router builds its tokenizer from a GGUF file's metadata and may resolve names.
    loaded = _loaded_after(["engine.tokenizer", "engine.model.gguf_checkpoint", "engine.model.model_registry"])
    heavy = sorted(m for m in ("torch", "transformers") if m in loaded)
    assert not heavy, f"GGUF metadata and model names must not need {heavy}"


def test_attention_backends_share_the_step_layout_without_importing_each_other():
    # The reference backend picks the Triton one in its factory; the Triton backend must
    # not need the reference module back (the step's layout lives on its own).
    loaded = _loaded_after(["engine.model.triton_attention"])
    assert "engine.model.step_layout" in loaded
    assert "engine.model.attention" not in loaded, "engine.model.triton_attention must not import engine.model.attention"


PROJECT_PACKAGES = ("bench", "cluster", "decode_worker", "engine", "kv_transfer", "prefill_worker", "router")
MAX_FUNCTION_LINES = 60


def test_no_function_outside_triton_kernels_is_over_60_lines():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    long = []
    for package in PROJECT_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and not kernel:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _package_imports() -> dict[tuple[str, str], str]:
    """(importer, imported) between the project's top-level packages, each with one place
    it happens: every import in the source, module level or inside a function."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    packages = (*PROJECT_PACKAGES, "sim", "tandem", "load", "protos")
    edges: dict[tuple[str, str], str] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in packages and top != package:
                        edges.setdefault((package, top), f"{path.relative_to(root)}:{node.lineno}")
    return edges


def test_no_two_packages_import_each_other_and_nothing_imports_the_command():
    edges = _package_imports()
    cycles = sorted(f"{a} <-> {b} ({edges[a, b]}, {edges[b, a]})" for a, b in edges if (b, a) in edges and a < b)
    assert not cycles, f"packages that import each other: {cycles}"
    above = sorted(f"{a} ({where})" for (a, b), where in edges.items() if b == "tandem")
    assert not above, f"the tandem command is the top: nothing imports it, but {above}"


# The parts behind the engine's door (``LLMEngine``'s own methods are the door).
ENGINE_INSIDES = {"scheduler", "kv_manager", "kv_cache", "remote_kv", "runner", "pen", "structured", "outputs"}


def _reaches_into_an_engine(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each ``engine.<part>`` or ``<x>.engine.<part>`` whose part is one
    of the engine's insides or private (an alias of the engine escapes this rule)."""
    import ast

    reaches = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        through = node.value
        via_engine = (isinstance(through, ast.Name) and through.id == "engine") or (
            isinstance(through, ast.Attribute) and through.attr == "engine")
        if via_engine and (node.attr in ENGINE_INSIDES or node.attr.startswith("_")):
            reaches.append((node.lineno, ast.unparse(node)))
    return reaches


def test_the_workers_reach_the_engine_only_through_its_door():
    """The workers call ``LLMEngine``'s methods; they never touch its scheduler, block
    manager, cache tensors, runner or other parts (docs/DESIGN.md, Engine rules)."""
    from pathlib import Path

    planted = "def f(self, engine):\n    self.engine.scheduler.held\n    engine.kv_cache.k\n    self.engine.load()\n"
    assert _reaches_into_an_engine(planted) == [(2, "self.engine.scheduler"), (3, "engine.kv_cache")]
    root = Path(__file__).resolve().parents[2]
    found = [
        f"{path.relative_to(root)}:{line} {expr}"
        for package in ("kv_transfer", "decode_worker", "prefill_worker", "cluster")
        for path in sorted((root / package).rglob("*.py"))
        for line, expr in _reaches_into_an_engine(path.read_text())
    ]
    assert not found, f"workers reaching past the engine's methods into its parts: {found}"
