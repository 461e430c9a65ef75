#!/usr/bin/python3
"""Draws the footprint charts from benchmarks/footprint's JSON (Debian's python3-matplotlib).

    bazel run -c opt //benchmarks:footprint -- --out /tmp/fp
    /usr/bin/python3 benchmarks/footprint_charts.py /tmp/fp/footprint.json docs/img

(/usr/bin/python3: Debian's interpreter, the one python3-matplotlib installs into.)

Writes footprint_world.png (device bytes per rank against world size, one line per stage, log
axes, one panel per preset, DeepSpeed's estimate dotted), footprint_breakdown.png (per-rank
bytes by buffer class, stacked, per stage) and footprint_measured.png (measured beside planned).

The whole device budget (docs/memory_budget.md), from `zerort plan --json` itself:

    bazel build //cli:zerort
    /usr/bin/python3 benchmarks/footprint_charts.py budget bazel-bin/cli/zerort docs/data docs/img

writes activations_vs_megatron.csv (the planned activation lines beside Korthikanti et al.'s
Table 2 for no, selective and full recompute), device_budget_per_rank.csv and
device_budget_per_rank.png (device bytes per rank by component, per stage and offload level),
and microbatch_fit.csv and microbatch_fit.png (`zerort plan --fit micro-batch`'s largest
micro-batch per stage and offload level), for the five presets at one sequence length.
"""
import csv
import json
import math
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
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


# ---- The whole device budget from `zerort plan` (mode "budget") ----------------------------

PRESETS = ["gpt2-124m", "gpt2-1.5b", "llama2-7b", "llama2-13b", "llama2-70b"]
# (layers, hidden, heads, vocabulary), as zero/model_spec.cc's presets publish them.
SHAPES = {
    "gpt2-124m": (12, 768, 12, 50257),
    "gpt2-1.5b": (48, 1600, 25, 50257),
    "llama2-7b": (32, 4096, 32, 32000),
    "llama2-13b": (40, 5120, 40, 32000),
    "llama2-70b": (80, 8192, 64, 32000),
}
SEQ = 1024        # GPT-2's context, within Llama 2's 4096: one length valid for all five
WORLD = 8
BUDGET = "80GiB"  # an 80 GB H100's device memory, for --fit
RECOMPUTE = "selective"  # the breakdown's activations: Megatron's default
# (stage, --offload) in the order of "stage": "auto"'s candidates.
CANDIDATES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "optimizer"),
              (2, "optimizer"), (3, "optimizer"), (3, "all")]
COMPONENTS = ["parameters", "gradients", "optimizer state", "buffers", "activations", "reserves"]
# The plan's buffer classes (memory/plan.h) by component; the rest are buffers.
CLASS_COMPONENT = {"params": "parameters", "grads": "gradients", "master": "optimizer state",
                   "exp_avg": "optimizer state", "exp_avg_sq": "optimizer state"}


def plan(zerort, *args):
    out = subprocess.run([zerort, "plan", "--json", *args], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def candidate_name(stage, offload):
    return {"none": f"stage {stage}", "optimizer": f"stage {stage} + opt. offload",
            "all": f"stage {stage} + opt. and param. offload"}[offload]


def megatron_layer_bytes(recompute, s, h, a, b=1):
    """Korthikanti et al. 2022, Table 2 (t = 1, no sequence parallelism): one layer's bytes."""
    return {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h,
            "full": 2 * s * b * h}[recompute]


def activations_table(zerort, data):
    rows = []
    for model in PRESETS:
        L, h, a, V = SHAPES[model]
        for recompute in ("none", "selective", "full"):
            d = plan(zerort, "--model", model, "--world", str(WORLD), "--stage", "3", "--seq",
                     str(SEQ), "--recompute", recompute)["device_budget"]
            lines = d["activations"]
            table2 = L * megatron_layer_bytes(recompute, SEQ, h, a)
            # The per-layer term must be the paper's, exactly: every other line is a named extra.
            assert lines["layers"] == table2, (model, recompute, lines["layers"], table2)
            assert sum(lines.values()) == d["activation_bytes"]
            rows.append({
                "model": model, "seq": SEQ, "micro_batch": 1, "recompute": recompute,
                "megatron_table2_bytes": int(table2),
                "zerort_layers_bytes": lines["layers"],
                "recompute_working_set_bytes": lines["recompute"],
                "embedding_output_bytes": lines["embedding+output"],
                "logits_bytes": lines["logits"],
                "logits_gradient_bytes": lines["logits gradient"],
                "zerort_total_bytes": d["activation_bytes"],
                "zerort_over_megatron": round(d["activation_bytes"] / table2, 4),
            })
    write_csv(f"{data}/activations_vs_megatron.csv", rows)
    return rows


def budget_rows(zerort):
    rows = []
    for model in PRESETS:
        for stage, offload in CANDIDATES:
            j = plan(zerort, "--model", model, "--world", str(WORLD), "--stage", str(stage),
                     "--offload", offload, "--seq", str(SEQ), "--recompute", RECOMPUTE)
            d = j["device_budget"]
            row = {"model": model, "candidate": candidate_name(stage, offload), "stage": stage,
                   "offload": offload, "world": WORLD, "seq": SEQ, "micro_batch": 1,
                   "recompute": RECOMPUTE}
            parts = dict.fromkeys(COMPONENTS, 0)
            for buf in j["buffers"]:
                if buf["kind"] == "device":
                    parts[CLASS_COMPONENT.get(buf["class"], "buffers")] += buf["bytes"]
            assert sum(parts.values()) == d["model_state_bytes"], (model, stage, offload)
            parts["activations"] = d["activation_bytes"]
            parts["reserves"] = d["reserve_bytes"]
            assert sum(parts.values()) == d["total_bytes"]
            row.update({f"{c.replace(' ', '_')}_bytes": v for c, v in parts.items()})
            row["total_bytes"] = d["total_bytes"]
            rows.append(row)
    return rows


def fit_rows(zerort):
    rows = []
    for recompute in ("selective", "full"):
        for model in PRESETS:
            fits = plan(zerort, "--model", model, "--world", str(WORLD), "--budget",
                        f"device={BUDGET}", "--seq", str(SEQ), "--recompute", recompute,
                        "--fit", "micro-batch")
            for f in fits:
                rows.append({"model": model, "candidate": f["candidate"], "world": WORLD,
                             "seq": SEQ, "recompute": recompute, "budget": BUDGET,
                             "micro_batch": f["micro_batch"],
                             "total_bytes": f["device_budget"]["total_bytes"],
                             "why_none": f["why_none"]})
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


def budget_chart(rows, out):
    fig, axes = plt.subplots(1, len(PRESETS), figsize=(4.2 * len(PRESETS), 5.2))
    cmap = plt.get_cmap("tab10")
    for ax, model in zip(axes, PRESETS):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"s{r['stage']}" + {"none": "", "optimizer": "+opt", "all": "+all"}[r["offload"]]
                  for r in mine]
        bottoms = [0.0] * len(mine)
        for i, c in enumerate(COMPONENTS):
            values = [r[f"{c.replace(' ', '_')}_bytes"] / GIB for r in mine]
            ax.bar(labels, values, bottom=bottoms, color=cmap(i), label=c)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.axhline(80, color="black", linestyle=":", linewidth=1)
        for x, total in enumerate(bottoms):
            ax.text(x, total, f"{total:.0f}" if total >= 10 else f"{total:.1f}", ha="center",
                    va="bottom", fontsize=6)
        ax.set_title(model, fontsize=10)
        ax.tick_params(axis="x", rotation=90, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("device GiB per rank")
    axes[0].plot([], [], color="black", linestyle=":", label="80 GiB")
    axes[-1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"device memory per rank by component: {WORLD} ranks, bf16, sequence {SEQ}, "
                 f"micro-batch 1, {RECOMPUTE} recompute (zerort plan; +opt: optimizer offload, "
                 f"+all: optimizer and parameter offload)", fontsize=10)
    fig.tight_layout()
    fig.savefig(f"{out}/device_budget_per_rank.png", dpi=90)


def short_candidate(name):
    """'stage 3 + optimizer and parameter offload' -> 's3+all' (ChoosePlan's wording)."""
    stage = name.split()[1]
    if "parameter" in name:
        return f"s{stage}+all"
    return f"s{stage}+opt" if "optimizer" in name else f"s{stage}"


def fit_chart(rows, out):
    recomputes = list(dict.fromkeys(r["recompute"] for r in rows))
    candidates = list(dict.fromkeys(r["candidate"] for r in rows))
    fig, axes = plt.subplots(len(recomputes), 1, figsize=(13, 4.2 * len(recomputes)),
                             squeeze=False)
    cmap = plt.get_cmap("tab10")
    width = 0.8 / len(PRESETS)
    for ax, recompute in zip([a for row in axes for a in row], recomputes):
        for k, model in enumerate(PRESETS):
            values = []
            for c in candidates:
                match = [r for r in rows if r["recompute"] == recompute and r["model"] == model
                         and r["candidate"] == c]
                values.append(match[0]["micro_batch"] if match else 0)
            xs = [i + (k - (len(PRESETS) - 1) / 2) * width for i in range(len(candidates))]
            bars = ax.bar(xs, [0.5 if v == 0 else v for v in values], width, color=cmap(k))
            for bar, v in zip(bars, values):
                if v == 0:
                    bar.set_alpha(0.25)
                ax.text(bar.get_x() + bar.get_width() / 2, max(v, 0.5) * 1.05, str(v),
                        ha="center", va="bottom", fontsize=6)
        ax.set_yscale("log", base=2)
        ax.set_ylim(0.4, 2 ** 9)
        ax.set_xticks(range(len(candidates)))
        ax.set_xticklabels([short_candidate(c) for c in candidates], fontsize=8)
        ax.set_ylabel("largest micro-batch")
        ax.set_title(f"{recompute} recompute", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    # Handles of their own: a pale first bar would make the legend's swatch pale.
    handles = [matplotlib.patches.Patch(color=cmap(k), label=m) for k, m in enumerate(PRESETS)]
    axes[0][0].legend(handles=handles, fontsize=8, ncol=len(PRESETS), loc="upper left")
    fig.suptitle(f"zerort plan --fit micro-batch: {WORLD} ranks of {BUDGET}, bf16, sequence "
                 f"{SEQ} (pale bars at 0: not even one sequence fits; +opt: optimizer offload, "
                 f"+all: optimizer and parameter offload)", fontsize=10)
    fig.tight_layout()
    fig.savefig(f"{out}/microbatch_fit.png", dpi=90)


def budget_main(zerort, data, img):
    activations_table(zerort, data)
    rows = budget_rows(zerort)
    write_csv(f"{data}/device_budget_per_rank.csv", rows)
    budget_chart(rows, img)
    fits = fit_rows(zerort)
    write_csv(f"{data}/microbatch_fit.csv", fits)
    fit_chart(fits, img)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "budget":
        budget_main(*sys.argv[2:])
        return
    if len(sys.argv) != 3:
        sys.exit("usage: footprint_charts.py FOOTPRINT_JSON OUT_DIR\n"
                 "       footprint_charts.py budget ZERORT_BINARY DATA_DIR IMG_DIR")
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    world_chart(doc["planned"], sys.argv[2])
    breakdown_chart(doc["planned"], sys.argv[2], [("gpt2-1.5b", 64), ("llama2-7b", 8)])
    measured_chart(doc["measured"], sys.argv[2])


if __name__ == "__main__":
    main()
