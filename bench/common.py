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


def add_engine_arguments(ap) -> None:
    """The engine settings a benchmark of one engine runs under: ``--device``, ``--dtype``
    and ``--attention-backend`` (``engine_overrides`` reads them back)."""
    ap.add_argument("--device", default="cpu", help="the engine's device: cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (bfloat16 on CUDA)")
    ap.add_argument("--attention-backend", default="auto", help="auto, cpu, triton or torch")


def engine_overrides(args) -> dict:
    """``LLMEngine`` keyword arguments from ``add_engine_arguments``' flags."""
    return {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend}


def device_kind(device: str) -> str:
    """The simulator's name (``sim.cost.DEVICES``) of the device an engine runs on: ``cpu``,
    or the CUDA device's kind read from its name (``NVIDIA H200`` -> ``H200``)."""
    if device == "cpu":
        return "cpu"
    import torch

    from sim.cost import DEVICES

    name = torch.cuda.get_device_name(torch.device(device))
    kinds = [kind for kind in DEVICES if kind != "cpu" and kind in name.upper()]
    if not kinds:
        raise SystemExit(f"{name} is none of the simulator's device kinds {sorted(DEVICES)}")
    return kinds[0]
