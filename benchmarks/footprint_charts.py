#!/usr/bin/python3
"""Draws the footprint charts from benchmarks/footprint's JSON (Debian's python3-matplotlib).

    bazel run -c opt //benchmarks:footprint -- --out /tmp/fp
    /usr/bin/python3 benchmarks/footprint_charts.py /tmp/fp/footprint.json docs/img

(/usr/bin/python3: Debian's interpreter, the one python3-matplotlib installs into.)

Writes footprint_world.png (device bytes per rank against world size, one line per stage, log
axes, one panel per preset, DeepSpeed's estimate dotted), footprint_breakdown.png (per-rank
bytes by buffer class, stacked, per stage) and footprint_measured.png (measured beside planned).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GIB = 2.0 ** 30
STAGE_COLORS = ["#444444", "#1f77b4", "#2ca02c", "#d62728"]
# Buffer classes in stacking order, with the label the chart shows.
CLASSES = [
    ("params", "params (bf16)"),
    ("grads", "grads (bf16)"),
    ("master", "master (fp32)"),
    ("exp_avg", "m (fp32)"),
    ("exp_avg_sq", "v (fp32)"),
    ("grad_bucket", "grad buckets"),
    ("gather_buffer", "gather slots"),
    ("persistent_params", "persistent units"),
    ("offload_staging", "offload staging"),
]


def world_chart(planned, out):
    models = list(dict.fromkeys(r["model"] for r in planned))
    cols = 3
    rows_n = (len(models) + cols - 1) // cols
    fig, grid = plt.subplots(rows_n, cols, figsize=(5 * cols, 4 * rows_n), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(models):]:
        ax.axis("off")
    for ax, model in zip(axes, models):
        for stage in range(4):
            rows = [r for r in planned
                    if r["model"] == model and r["stage"] == stage and r["offload"] == "none"]
            worlds = [r["world"] for r in rows]
            ax.plot(worlds, [r["planned"]["device"] / GIB for r in rows], marker="o",
                    markersize=3, color=STAGE_COLORS[stage], label=f"stage {stage}")
            ax.plot(worlds, [r["deepspeed"]["gpu"] / GIB for r in rows], linestyle=":",
                    color=STAGE_COLORS[stage])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model} ({rows[0]['params'] / 1e9:.2f}B params)", fontsize=10)
        ax.set_xlabel("world size (ranks)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("device GiB per rank (bf16, no offload)")
    axes[0].plot([], [], linestyle=":", color="black", label="DeepSpeed estimate")
    axes[0].legend(fontsize=8)
    fig.suptitle("zerort planned device memory per rank (solid) vs DeepSpeed's estimator (dotted)")
    fig.tight_layout()
    fig.savefig(f"{out}/footprint_world.png", dpi=90)


def breakdown_chart(planned, out, cases):
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5))
    for ax, (model, world) in zip(axes, cases):
        labels, bottoms = [], None
        rows = []
        for stage in range(4):
            for offload in ("none", "optimizer"):
                match = [r for r in planned if r["model"] == model and r["world"] == world
                         and r["stage"] == stage and r["offload"] == offload]
                if match:
                    rows.append(match[0])
                    labels.append(f"s{stage}" + ("+off" if offload == "optimizer" else ""))
        bottoms = [0.0] * len(rows)
        cmap = plt.get_cmap("tab10")
        for i, (cls, label) in enumerate(CLASSES):
            values = [r["planned"]["classes"].get(cls, 0) / GIB for r in rows]
            ax.bar(labels, values, bottom=bottoms, color=cmap(i), label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set_title(f"{model} on {world} ranks: bytes per rank by buffer (all memory kinds)",
                     fontsize=10)
        ax.set_ylabel("GiB per rank")
        ax.grid(True, axis="y", alpha=0.3)
    axes[-1].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(f"{out}/footprint_breakdown.png", dpi=90)


def measured_chart(measured, out):
    rows = [r for r in measured if "error" not in r]
    labels = [f"{r['model']}\nw{r['world']} s{r['stage']}" + (" off" if r["offload"] != "none"
                                                               else "") for r in rows]
    planned = [r["planned_bytes_all_ranks"] / r["world"] / 2 ** 20 for r in rows]
    allocated = [r["allocated_bytes_all_ranks"] / r["world"] / 2 ** 20 for r in rows]
    rss = [r["rss_growth"] / r["world"] / 2 ** 20 for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(10, 0.45 * len(rows)), 8), sharex=True)
    x = range(len(rows))
    w = 0.28
    ax.bar([i - w for i in x], planned, w, label="planned")
    ax.bar(list(x), allocated, w, label="allocator counters")
    ax.bar([i + w for i in x], rss, w, label="RSS growth")
    ax.set_yscale("log")
    ax.set_ylabel("MiB per rank")
    ax.legend(fontsize=8)
    ax.set_title("measured beside planned (in-process ranks; per rank = process total / world)")
    ax2.plot(list(x), [r["rss_growth_over_planned"] for r in rows], "o", label="RSS growth / planned")
    ax2.plot(list(x), [r["allocated_over_planned"] for r in rows], "x",
             label="allocated / planned")
    ax2.axhspan(0.99, 1.01, color="green", alpha=0.15, label="goal 1.00 +- 0.01")
    ax2.set_ylabel("measured / planned")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, rotation=90, fontsize=7)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{out}/footprint_measured.png", dpi=90)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: footprint_charts.py FOOTPRINT_JSON OUT_DIR")
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    world_chart(doc["planned"], sys.argv[2])
    breakdown_chart(doc["planned"], sys.argv[2], [("gpt2-1.5b", 64), ("llama2-7b", 8)])
    measured_chart(doc["measured"], sys.argv[2])


if __name__ == "__main__":
    main()
