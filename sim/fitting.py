"""Cost models fitted from measured steps: profile tables, the fit, and ``cost_model``, a
device kind's ``sim.cost.CostModel`` as ``tandem sim`` and ``tandem plan`` build it.

The profile table (``step_profile`` / ``read_profile``; ``python -m bench.steps
--profile FILE`` writes one on this CPU) is one JSON object::

    {"format": "tandem-step-profile/1", "device": "cpu", "dtype_bytes": 4,
     "model": {ModelSpec fields}, "rows": [{"batch": 8, "num_tokens": 8,
     "prefill_tokens": 0, "attn_pairs": 1060, "kv_read_tokens": 1060,
     "num_sampled": 8, "step_ms": 9.1}, ...]}

A table timed inside a live service's workers (``bench.sim live-validate --live-profile``)
also has, per row, the step's ``role``, ``others_busy`` (the other workers mid-step as
it began) and ``in_flight`` (the requests in flight then): the workers and the service
share the host's cores. ``live_corrections`` reads them into the ``CostModel``'s
``contention`` (``sim.contention``). Its ``service_path`` is the request's way through
the service: the delays measured, by requests in flight (``sim.service_path``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np

from engine.core.step_shape import StepShape
from sim.contention import ANY_ROLE, NO_CONTENTION, Contention
from sim.cost import DEVICES, GPU_DEFAULTS, Corrections, CostModel, DeviceSpec, ModelSpec
from sim.service_path import NO_DELAY, ServicePath

PROFILE_FORMAT = "tandem-step-profile/1"
GPU_PROFILE_FORMAT = "tandem-gpu-profile/1"  # bench.gpu's kernel table (docs/BENCHMARKS.md)
PROFILES = Path(__file__).resolve().parent / "profiles"  # tables measured here, by device and model


FEATURES = ("num_tokens", "attn_pairs", "kv_read_tokens", "batch")


def step_profile(device: str, model: ModelSpec, dtype_bytes: int, rows: list[dict]) -> dict:
    """A profile table: each row a ``StepShape``'s fields plus the measured ``step_ms``."""
    return {"format": PROFILE_FORMAT, "device": device, "dtype_bytes": dtype_bytes, "model": asdict(model),
            "rows": rows}


def profile_row(shape: StepShape, step_ms: float) -> dict:
    return {**{f.name: getattr(shape, f.name) for f in fields(StepShape) if f.name != "swap_blocks"},
            "step_ms": round(step_ms, 4)}


def gpu_corrections(doc: dict, device: DeviceSpec, source: str) -> Corrections:
    """The corrections a ``bench.gpu`` table gives: ``mbu`` from its paged decode attention
    (or its copy) over the HBM bandwidth, ``mfu`` from its prefill attention over the bf16
    FLOP/s (each capped at 1; a share it did not measure stays assumed, ``GPU_DEFAULTS``);
    and where it carries the engine's step profile (``step_profile``), the engine's costs
    beyond the roofline fitted from it (``fit`` at those shares). One model's steps cannot
    tell a per-step cost from a per-layer one; an engine that launches its kernels one by
    one from Python spends it per layer, so the fitted constant goes to ``per_layer_s`` and
    scales with another model's depth."""
    best: dict[str, float] = {}
    for row in doc.get("rows", []):
        if row.get("op") in ("decode_attention", "copy", "prefill_attention") and row.get("throughput", 0) > 0:
            best[row["op"]] = max(best.get(row["op"], 0.0), float(row["throughput"]))
    bw = best.get("decode_attention") or best.get("copy")
    mbu = min(1.0, bw * 1e12 / device.hbm_bw) if bw else GPU_DEFAULTS.mbu
    flops = best.get("prefill_attention")
    mfu = min(1.0, flops * 1e12 / device.flops) if flops else GPU_DEFAULTS.mfu
    steps = doc.get("step_profile")
    if not steps:
        return replace(GPU_DEFAULTS, mfu=mfu, mbu=mbu, source=source)
    model = ModelSpec(**steps["model"])
    fitted = fit(device, model, steps["rows"], source, mfu=mfu, mbu=mbu)
    return replace(fitted, overhead_s=0.0, per_layer_s=fitted.overhead_s / model.num_layers)


def read_profile(path: str | Path) -> dict:
    """A profile table, checked: ValueError names what is missing."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") == GPU_PROFILE_FORMAT:
        return doc
    if doc.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: not a {PROFILE_FORMAT} table (format {doc.get('format')!r})")
    for i, row in enumerate(doc["rows"]):
        missing = [k for k in (*FEATURES, "step_ms") if k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {missing}")
    return doc


def _shape(row: dict) -> StepShape:
    return StepShape(**{f.name: row.get(f.name, 0) for f in fields(StepShape)})


def fit(device: DeviceSpec, model: ModelSpec, rows: list[dict], source: str = "profile", mfu: float = 1.0,
        mbu: float = 1.0) -> Corrections:
    """Corrections fitted to measured steps: non-negative least squares of what the roofline
    at shares ``mfu`` and ``mbu`` of peak leaves (measured - roofline) over a constant, batch,
    tokens, attention pairs and KV tokens, each row weighted by 1 / its time (relative errors
    count, so short decode steps weigh as much as long prefills). ``per_layer_s`` stays 0:
    one model per table."""
    base = CostModel(device, model, Corrections(mfu=mfu, mbu=mbu))
    cols, target = [], []
    for r in rows:
        w = 1e3 / r["step_ms"]
        cols.append([w, w * r["batch"], w * r["num_tokens"], w * r["attn_pairs"], w * r["kv_read_tokens"]])
        target.append(w * (r["step_ms"] / 1e3 - base.roofline_s(_shape(r))))
    coef = nnls(cols, target)
    return Corrections(overhead_s=coef[0], per_request_s=coef[1], mfu=mfu, mbu=mbu, per_token_s=coef[2],
                       per_pair_s=coef[3], per_kv_token_s=coef[4], source=source)


def nnls(a: list[list[float]], b: list[float], iters: int = 20) -> list[float]:
    """Least squares with every coefficient >= 0: solve, drop the negative ones, solve again
    (columns scaled to unit norm first)."""

    A, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale
    active = np.ones(A.shape[1], dtype=bool)
    x = np.zeros(A.shape[1])
    for _ in range(iters):
        x = np.zeros(A.shape[1])
        if active.any():
            x[active] = np.linalg.lstsq(As[:, active], y, rcond=None)[0]
        if (x >= 0).all():
            break
        active &= x > 0
    return [float(v) for v in np.maximum(x, 0) / scale]


def cost_model(device: str, model: ModelSpec, profile: str | Path | None = None, link: str | None = None) -> CostModel:
    """The cost model of a device kind: fitted from ``profile`` when given (for the CPU, by
    default the table shipped for the model in ``sim/profiles``, if there is one), else the
    assumed corrections (``GPU_DEFAULTS``; none for the CPU, whose roofline alone is far too
    fast)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device kind {device!r}: one of {sorted(DEVICES)}")
    spec = DEVICES[device]
    shipped = PROFILES / f"{device}-{model.name}.json"
    if profile is None and not spec.is_gpu and shipped.exists():
        profile = shipped
    corrections, service_path, contention = None, NO_DELAY, NO_CONTENTION
    if profile is not None:
        doc = read_profile(profile)
        if doc["format"] == GPU_PROFILE_FORMAT:
            if device not in doc.get("device", ""):
                raise ValueError(f"{profile} was measured on {doc.get('device')!r}, not {device!r}")
            return CostModel(spec, model, gpu_corrections(doc, spec, str(profile)), link or "ib")
        if doc["device"] != device:
            raise ValueError(f"{profile} was measured on {doc['device']!r}, not {device!r}")
        spec = replace(spec, dtype_bytes=doc.get("dtype_bytes", spec.dtype_bytes))
        corrections, contention = live_corrections(spec, model, doc["rows"], str(profile))
        if "service_path" in doc:
            service_path = ServicePath.from_json(doc["service_path"])
    return CostModel(spec, model, corrections, link or ("ib" if spec.is_gpu else "pcie"),
                     service_path=service_path, contention=contention)


MIN_ALONE_STEPS = 20  # steps begun alone, at least, to fit a shared host's costs on


def live_corrections(device: DeviceSpec, model: ModelSpec, rows: list[dict],
                     source: str) -> tuple[Corrections, Contention]:
    """``fit``, and for steps timed in live workers that shared a host's cores (rows with
    ``others_busy``: the other workers mid-step as each began), the contention
    (``sim.contention``): the corrections are fitted to the steps begun alone, and each
    step's slowdown is its measured over its fitted time, kept by its ``role``, the others
    mid-step and the requests ``in_flight`` as it began. (Begun alone, not run alone: a
    step that no other overlapped is likelier a short one.) Rows without ``others_busy``
    (``bench.steps``: one engine alone) have none."""
    alone = [r for r in rows if r.get("others_busy", 0) == 0]
    if len(alone) == len(rows) or len(alone) < MIN_ALONE_STEPS:
        return fit(device, model, rows, source=source), NO_CONTENTION
    corrections = fit(device, model, alone, source=source)
    cost = CostModel(device, model, corrections)
    steps = []
    for r in rows:
        alone_s = cost.step_s(_shape(r))
        if alone_s > 0:  # (a step whose plan came out empty has no work to compare)
            steps.append((r.get("role", ANY_ROLE), r.get("others_busy", 0), r.get("in_flight", 0),
                          r["step_ms"] / (1e3 * alone_s)))
    return corrections, Contention.fit(steps)


def relative_error(cost: CostModel, rows: list[dict]) -> float:
    """The mean |predicted - measured| / measured over a table's rows."""
    errs = [abs(cost.step_s(_shape(r)) * 1e3 - r["step_ms"]) / r["step_ms"] for r in rows if r["step_ms"] > 0]
    return sum(errs) / len(errs) if errs else math.nan
