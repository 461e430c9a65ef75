#!/usr/bin/env python3
"""Markdown tables from a GPU bundle run's OUT/benchmarks.json (tools/gpu_bundle/run.sh), for
docs/cuda.md and docs/benchmarks.md: every cuda_bench kernel row as its fraction of the
device-to-device copy measured in the same process, AdamW beside torch's fused AdamW of the same
run, the transfers, and the step and GPT benchmarks when present.

Usage: tools/gpu_bundle/summarize.py OUT/benchmarks.json
"""
import json
import sys


def documents(text):
    decoder = json.JSONDecoder()
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return
        doc, i = decoder.raw_decode(text, i)
        yield doc


def label(k):
    extra = {key: v for key, v in k.items()
             if key in ("grad", "param_out", "src", "dst", "dtype", "ranks", "op", "offset")}
    return k["kernel"] + (" " + ", ".join(f"{a}={b}" for a, b in extra.items()) if extra else "")


def main():
    docs = list(documents(open(sys.argv[1]).read()))
    by_size = {}  # elements -> {label: (median_ms, fraction)}
    copy_ms = {}
    transfers = []
    host_calls = []
    torch_adamw = {}
    others = []
    steps = []
    device = ""
    for d in docs:
        name = d.get("benchmark")
        device = d.get("device", device)
        if "skipped" in d:
            print(f"- {name}: skipped: {d['skipped']}")
        elif name == "cuda_bench":
            for size in d.get("sizes", []):
                n = size["elements"]
                if "skipped" in size:
                    continue
                copy_ms[n] = size["d2d_copy"]["median_ms"]
                for k in size["kernels"]:
                    by_size.setdefault(n, {})[label(k)] = (k["median_ms"],
                                                           k["fraction_of_d2d_copy"])
            transfers += d.get("transfers", [])
            host_calls += d.get("host_calls", [])
        elif name == "gpu_step_bench":
            steps.append(d)
        elif name == "adamw_torch_ref":
            for size in d["sizes"]:
                torch_adamw[size["elements"]] = size["adamw_fused"]
        else:
            others.append(d)
    sizes = sorted(by_size)
    if sizes:
        print(f"\nDevice: {device}. Fraction of the device-to-device copy of the same bytes "
              "(median ms in brackets):\n")
        print("| kernel | " + " | ".join(f"n = {n:.0e}" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        print("| d2d copy | " + " | ".join(f"1.00 ({copy_ms[n]:.3f})" for n in sizes) + " |")
        labels = list(dict.fromkeys(l for n in sizes for l in by_size[n]))
        for l in labels:
            cells = []
            for n in sizes:
                v = by_size[n].get(l)
                cells.append(f"{v[1]:.2f} ({v[0]:.3f})" if v else "-")
            print(f"| {l} | " + " | ".join(cells) + " |")
    for n, t in sorted(torch_adamw.items()):
        ours = by_size.get(n, {}).get("adamw grad=fp32, param_out=none")
        if ours:
            print(f"\nAdamW at n = {n:.0e} (fp32 grads, no param copy, 28 B/element): zerort "
                  f"{ours[0]:.3f} ms, torch.optim.AdamW(fused=True) {t['median_ms']:.3f} ms: "
                  f"{t['median_ms'] / ours[0]:.2f}x torch's bytes per second")
    for d in steps:
        print(f"\ngpu_step_bench ({d.get('device')}, grads {d.get('grads')}, host sync "
              f"{d.get('host_sync', 'spin')}):\n")
        print("| shape | stage | offload | units | step ms | floor ms | ratio | norm ms | "
              "host us/unit | host return ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for c in d.get("configs", []):
            head = f"| {c['shape']} | {c['stage']} | {c['offload']} | "
            if "step_ms_median" not in c:
                why = c.get("error") or c.get("not_run", "")
                print(head + f"- | {why[:80]} | | | | | |")
                continue
            host = c.get("host", {})
            print(head + f"{c['units']} | {c['step_ms_median']:.2f} | {c['floor_ms']:.2f} | "
                  f"{c['ratio_to_floor']:.2f} | {c['device_times']['norm_ms']:.2f} | "
                  f"{host.get('cpu_us_per_unit', float('nan')):.1f} | "
                  f"{host.get('return_ms_median', float('nan')):.2f} |")
    for t in transfers:
        print(f"\ntransfer: {json.dumps(t)}")
    if host_calls:
        print("\nHost cost per call (us, median / best):\n")
        print("| call | median | best |")
        print("|---|---|---|")
        for c in host_calls:
            print(f"| {c['call']} | {c['us_per_call_median']:.2f} | {c['us_per_call_best']:.2f} |")
    for d in others:
        print(f"\n{d.get('benchmark')}: {json.dumps(d)[:2000]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
