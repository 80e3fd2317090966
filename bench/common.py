"""Helpers every benchmark program shares."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(path: str | Path, result: dict) -> Path:
    """Write a benchmark's result as indented JSON (folders made as needed); say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out


def init_local_ray(num_cpus: int = 2) -> None:
    """Start a small local Ray for a benchmark program, unless this process has one."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING")
