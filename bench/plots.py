"""PNG plots of a serving benchmark: latency CDFs per run, and a request-rate sweep.

matplotlib with the Agg backend, so plots are written on machines without a display.
Inputs are plain numbers (milliseconds, requests/s), one entry per run, keyed by the
run's label (its request rate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

LATENCIES = ("TTFT", "ITL", "E2E")


def latency_cdfs(runs: Mapping[str, Mapping[str, Sequence[float]]], path: Path) -> Path:
    """One panel per latency in ``LATENCIES``, one step line per run.

    ``runs``: run label -> latency name -> samples in ms.
    """
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 4), constrained_layout=True)
    for ax, name in zip(axes, LATENCIES):
        for label, latencies in runs.items():
            values = sorted(latencies.get(name, ()))
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title="request rate", fontsize="small")
    return _save(fig, path)


def sweep(
    rates: Sequence[str],
    p99_ttft_ms: Sequence[float | None],
    p99_itl_ms: Sequence[float | None],
    goodput: Sequence[float | None],
    goodput_label: str,
    path: Path,
) -> Path:
    """p99 TTFT, p99 ITL and goodput against the offered request rate.

    Rates sit at evenly spaced positions labelled with their value, so that an
    infinite rate (everything at once) has a place on the axis too.
    """
    panels = (("p99 TTFT (ms)", p99_ttft_ms), ("p99 ITL (ms)", p99_itl_ms), (goodput_label, goodput))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), constrained_layout=True)
    positions = list(range(len(rates)))
    for ax, (title, values) in zip(axes, panels):
        points = [(x, v) for x, v in zip(positions, values) if v is not None]
        if points:
            ax.plot([x for x, _ in points], [v for _, v in points], marker="o")
        ax.set_xticks(positions, list(rates))
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
