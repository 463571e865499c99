"""Matplotlib figures for the reports (PNG files, embedded in report.html as data URIs)."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

# A rank's bytes at its peak moment: in backward, or at the optimizer step (its transients).
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step")
MEMORY_COLOURS = {"params": "#4C78A8", "grads": "#72B7B2", "optimizer": "#F58518", "activations": "#E45756",
                  "buffers": "#B279A2", "optimizer_step": "#EECA3B"}
TIME_COLOURS = {"compute": "#4C78A8", "recompute": "#9ECAE9", "tp_comm": "#F58518", "cp_comm": "#FFBF79",
                "ep_comm": "#72B7B2", "pp_comm": "#54A24B", "dp_comm": "#E45756", "bubble": "#BAB0AC",
                "optimizer": "#B279A2"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_figure(stage_details: list[dict[str, Any]], path: str | Path) -> None:
    """Stacked bar per pipeline rank at its peak moment (backward, or the optimizer step and its
    transients) vs the memory the plan may use (capacity) and the GPU's size."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(max(5.0, 1.0 + 0.7 * len(stage_details)), 3.6))
    gib = 2**30
    labels: set[str] = set()
    for d, detail in enumerate(stage_details):
        bottom = 0.0
        for part in MEMORY_PARTS:
            value = detail["memory_breakdown"].get(part, 0) / gib
            labelled = part not in labels and part in detail["memory_breakdown"]
            if labelled:
                labels.add(part)
            axes.bar(d, value, bottom=bottom, color=MEMORY_COLOURS[part], label=part if labelled else None, width=0.6)
            bottom += value
        capacity = detail["memory_breakdown"]["capacity"] / gib
        total = (detail["memory_breakdown"]["capacity"] + detail["memory_breakdown"]["headroom"]) / gib
        axes.hlines(capacity, d - 0.4, d + 0.4, colors="black", linestyles="--",
                    label="usable (capacity)" if d == 0 else None)
        axes.hlines(total, d - 0.4, d + 0.4, colors="grey", linestyles=":", label="GPU memory" if d == 0 else None)
    axes.set_xticks(range(len(stage_details)))
    axes.set_xticklabels([f"PP {d['pp_rank']}" for d in stage_details], fontsize=8)
    axes.set_ylabel("GiB per GPU")
    axes.set_title("memory per rank (one representative per pipeline rank)", fontsize=10)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def time_figure(time_breakdown: dict[str, float], path: str | Path) -> None:
    """One horizontal stacked bar: where the step's time goes on the critical pipeline rank."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(9, 2.0))
    scale, unit = (1e3, "ms") if sum(time_breakdown.values()) < 10 else (1.0, "s")
    left = 0.0
    for part, seconds in time_breakdown.items():
        if seconds <= 0:
            continue
        axes.barh(0, seconds * scale, left=left, color=TIME_COLOURS.get(part, "#888888"), label=part, height=0.6)
        left += seconds * scale
    axes.set_yticks([])
    axes.set_xlabel(f"time per step ({unit})")
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def scaling_figure(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Throughput and MFU against GPUs, one line per series (cluster preset and other settings)."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("tokens_per_s") is not None or row.get("samples_per_s") is not None:
            series.setdefault(row["series"], []).append(row)
    for name, points in sorted(series.items()):
        points.sort(key=lambda row: row["gpus"])
        gpus = [row["gpus"] for row in points]
        rate = [row["tokens_per_s"] if row.get("tokens_per_s") is not None else row["samples_per_s"] for row in points]
        left.plot(gpus, rate, marker="o", label=name)
        right.plot(gpus, [100 * row["mfu"] for row in points], marker="o", label=name)
    unit = "tokens/s" if any(row.get("tokens_per_s") for row in rows) else "samples/s"
    ticks = sorted({row["gpus"] for points in series.values() for row in points})
    for axes, label in ((left, f"throughput ({unit})"), (right, "MFU (%)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(t) for t in ticks])
        axes.minorticks_off()
        axes.set_xlabel("GPUs")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    left.set_yscale("log")
    right.set_ylim(bottom=0)
    if series:
        right.legend(fontsize=7, frameon=False)
    figure.suptitle("predicted scaling", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def data_uri(path: str | Path) -> str:
    """A PNG as a data: URI, so the HTML report needs no other file and no network."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def loss_figure(curves: Any, path: str | Path) -> None:
    """Training loss per step (light) under its moving average, and validation loss as points on
    a line (``curves``: report.training.LossCurves)."""
    from autopar.report.training import moving_average, smoothing_window

    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 3.6))
    if curves.train:
        steps, losses = zip(*curves.train)
        window = smoothing_window(len(losses))
        axes.plot(steps, losses, color="#4C78A8", alpha=0.35 if window > 1 else 1.0, linewidth=1,
                  label="train loss")
        if window > 1:
            axes.plot(steps, moving_average(list(losses), window), color="#4C78A8", linewidth=2,
                      label=f"train loss, mean of {window} steps")
    if curves.validation:
        steps, losses = zip(*curves.validation)
        axes.plot(steps, losses, color="#E45756", marker="o", markersize=4, linewidth=1.5, label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, frameon=False)
    axes.set_title("training run (run.jsonl)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
