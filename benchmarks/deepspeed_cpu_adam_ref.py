#!/usr/bin/env python3
"""DeepSpeedCPUAdam and torch.optim.AdamW(fused=True) on the host, beside zerort's adamw_bench:
the anchors of issue 26's host-step goals, run on the same machine in one go (outside CI).

Each optimizer updates one flat tensor of n parameters per step (lr 1e-3, betas 0.9/0.95,
eps 1e-8, weight decay 0.1, decoupled), timed with perf_counter around step() after one warm-up
step that creates the state; the best and the median of --reps steps are reported, with bytes
per parameter counted as adamw_bench counts them (reads + writes). Modes:

  deepspeed_fp32          fp32 param, fp32 grad, fp32 m/v                          32 bytes
  deepspeed_mixed         fp32 master, fp32 grad, fp32 m/v, then the bf16 copy:     34 bytes
                          in the same call where this DeepSpeed takes
                          fp16_param_groups, else a separate copy_ (as ZeRO-Offload does)
  deepspeed_bf16_states   bf16 param (the master), bf16 grad, bf16 m/v             14 bytes
                          (fp32_optimizer_states=False: bf16_master_weights_and_grads
                          with bf16_optimizer_states; rounds to nearest, not stochastically)
  torch_fused_fp32        torch.optim.AdamW(fused=True), fp32 everything           32 bytes
  torch_fused_bf16        the same on bf16 param, grad and state                   14 bytes

zerort's matching rows (adamw_bench): "results" dtype fp32 (32 bytes); dtype bf16 (bf16 grad in,
bf16 param out, 28 bytes: the mixed-precision step); "forms" bf16_stochastic + bf16 moments
(14 bytes) for the bf16-state mode. With --adamw_bench PATH the script runs that binary for the
same sizes and puts its JSON under "zerort".

DeepSpeed builds its CPU Adam extension (C++, with ninja) on first use: the first run takes
minutes. Needs: pip install torch deepspeed (CPU is enough). Without them it prints
{"benchmark": "deepspeed_cpu_adam_ref", "skipped": "<reason>"} and exits 0.

Usage: deepspeed_cpu_adam_ref.py [--elements N ...] [--reps R] [--threads T]
                                 [--adamw_bench bazel-bin/benchmarks/adamw_bench]
"""
import argparse
import contextlib
import inspect
import json
import statistics
import subprocess
import sys
import time

BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 1e-3, 0.1


def timed(fn, reps):
    """Sorted seconds of each fn() call, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def row(name, n, times, bytes_per_param, note=""):
    best, median = times[0], statistics.median(times)
    r = {"mode": name, "elements": n, "bytes_per_param": bytes_per_param,
         "best_ms": best * 1e3, "median_ms": median * 1e3,
         "params_per_s_best": n / best, "gb_per_s_best": bytes_per_param * n / best / 1e9}
    if note:
        r["note"] = note
    print(f"{name}: n={n} best {best * 1e3:.1f} ms, {n / best:.3g} params/s", file=sys.stderr)
    return r


def param_with_grad(torch, n, dtype):
    p = torch.nn.Parameter(torch.rand(n, dtype=torch.float32).to(dtype))
    p.grad = (torch.rand(n, dtype=torch.float32) * 1e-3 - 5e-4).to(dtype)
    return p


def mixed_step(torch, opt, p):
    """DeepSpeedCPUAdam's mixed-precision step on p and a bf16 copy of it, and how it is made:
    in the same call where this DeepSpeed takes fp16_param_groups, else step() then copy_."""
    copy = torch.empty(p.numel(), dtype=torch.bfloat16)
    if "fp16_param_groups" in inspect.signature(type(opt).step).parameters:
        return (lambda: opt.step(fp16_param_groups=[[copy]]),
                "bf16 copy written by step(fp16_param_groups=...)")
    return (lambda: (opt.step(), copy.copy_(p.data)),
            "this DeepSpeed has no fp16_param_groups: step() then a separate bf16 copy_")


def deepspeed_rows(torch, n, reps):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    init = inspect.signature(DeepSpeedCPUAdam.__init__).parameters
    rows = []
    p = param_with_grad(torch, n, torch.float32)
    opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    rows.append(row("deepspeed_fp32", n, timed(opt.step, reps), 32))
    step, note = mixed_step(torch, opt, p)
    rows.append(row("deepspeed_mixed", n, timed(step, reps), 34, note))
    del opt, p
    if "fp32_optimizer_states" in init:
        p = param_with_grad(torch, n, torch.bfloat16)
        opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               adamw_mode=True, fp32_optimizer_states=False)
        rows.append(row("deepspeed_bf16_states", n, timed(opt.step, reps), 14))
    else:
        rows.append({"mode": "deepspeed_bf16_states", "elements": n,
                     "skipped": "this DeepSpeedCPUAdam has no fp32_optimizer_states"})
    return rows


def torch_rows(torch, n, reps):
    rows = []
    for dtype, name, nbytes in ((torch.float32, "torch_fused_fp32", 32),
                                (torch.bfloat16, "torch_fused_bf16", 14)):
        p = param_with_grad(torch, n, dtype)
        try:
            opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                    fused=True)
            rows.append(row(name, n, timed(opt.step, reps), nbytes))
        except (RuntimeError, ValueError) as e:
            rows.append({"mode": name, "elements": n, "skipped": str(e)})
    return rows


def run_zerort(path, sizes):
    """adamw_bench's JSON for the smallest..largest size asked for."""
    cmd = [path, f"--min_params={min(sizes):g}", f"--max_params={max(sizes):g}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {"command": " ".join(cmd), "output": json.loads(out)}


def zerort_row(doc, key, n, threads, **match):
    """adamw_bench's row of `key` ("results" or "forms") for n, threads and the fields given."""
    for r in doc.get(key, []):
        if r["params"] == n and r["threads"] == threads and all(
                r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"adamw_bench printed no {key} row for n={n} threads={threads} {match}")


def interleaved(torch, path, n, rounds, reps, threads):
    """Rounds of DeepSpeed's mixed-precision step beside adamw_bench at the same size, in turn,
    so that each round's ratios compare figures measured under the same load. Besides ours, each
    round divides our memory floors by DeepSpeed's step: the speed no implementation of our
    access pattern can pass on this machine (the floor streams exactly its bytes, trivially)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    p = param_with_grad(torch, n, torch.float32)
    opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    mixed, _ = mixed_step(torch, opt, p)
    cmd = [path, f"--min_params={n}", f"--max_params={n}", "--forms=all"]
    out = []
    for k in range(rounds):
        ds_fp32 = timed(opt.step, reps)[0]
        ds_mixed = timed(mixed, reps)[0]
        z = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        ours = zerort_row(z, "results", n, threads, dtype="bf16")
        ours_fp32 = zerort_row(z, "results", n, threads, dtype="fp32")
        lossless = zerort_row(z, "forms", n, threads, master_form="bf16_remainder",
                              moment_dtype="fp32")
        ds_mixed_rate = n / ds_mixed
        r = {"round": k, "elements": n, "threads": threads,
             "deepspeed_fp32_params_per_s": n / ds_fp32,
             "deepspeed_fp32_gbps": 32 * n / ds_fp32 / 1e9,
             "deepspeed_mixed_params_per_s": ds_mixed_rate,
             "deepspeed_mixed_gbps": 34 * n / ds_mixed / 1e9,
             "ours_mixed_params_per_s": ours["adamw_params_per_s"],
             "ours_mixed_floor_params_per_s": ours["floor_params_per_s"],
             "ours_fp32_floor_gbps": 32 * ours_fp32["floor_params_per_s"] / 1e9,
             "ours_lossless_params_per_s": lossless["adamw_params_per_s"],
             "ours_lossless_floor_params_per_s": lossless["floor_params_per_s"],
             "ours_over_deepspeed": ours["adamw_params_per_s"] / ds_mixed_rate,
             "ours_floor_over_deepspeed": ours["floor_params_per_s"] / ds_mixed_rate,
             "lossless_over_deepspeed": lossless["adamw_params_per_s"] / ds_mixed_rate,
             "lossless_floor_over_deepspeed": lossless["floor_params_per_s"] / ds_mixed_rate}
        print(f"round {k} n={n}: ours/DeepSpeed mixed {r['ours_over_deepspeed']:.2f}, our floor "
              f"{r['ours_floor_over_deepspeed']:.2f}, lossless {r['lossless_over_deepspeed']:.2f} "
              f"(floor {r['lossless_floor_over_deepspeed']:.2f})", file=sys.stderr)
        out.append(r)
    summary = {"elements": n, "threads": threads, "rounds": rounds}
    for key in ("ours_over_deepspeed", "ours_floor_over_deepspeed", "lossless_over_deepspeed",
                "lossless_floor_over_deepspeed"):
        v = sorted(r[key] for r in out)
        summary[key] = {"min": v[0], "median": statistics.median(v), "max": v[-1]}
    return {"summary": summary, "rounds": out}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", nargs="+", type=float, default=[1e7, 1e8])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--adamw_bench", default="", help="path of zerort's adamw_bench")
    parser.add_argument("--interleave", type=int, default=0,
                        help="R > 0: instead of the rows above, R rounds per size of "
                             "DeepSpeed's fp32 and mixed steps then adamw_bench, in turn "
                             "(needs --adamw_bench and --threads)")
    args = parser.parse_args()
    doc = {"benchmark": "deepspeed_cpu_adam_ref"}
    try:
        import torch
        # DeepSpeed's logger writes to the stdout it finds at import: keep the JSON clean.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
    except ImportError as e:
        doc["skipped"] = f"needs torch and deepspeed: {e}"
        print(json.dumps(doc, indent=2))
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    doc.update(torch=torch.__version__, deepspeed=deepspeed.__version__,
               threads=torch.get_num_threads())
    sizes = [int(n) for n in args.elements]
    if args.interleave > 0:
        if not args.adamw_bench or args.threads <= 0:
            parser.error("--interleave needs --adamw_bench and --threads")
        doc["interleaved"] = [interleaved(torch, args.adamw_bench, n, args.interleave,
                                          args.reps, args.threads) for n in sizes]
        print(json.dumps(doc, indent=2))
        return 0
    doc["results"] = []
    for n in sizes:
        doc["results"] += deepspeed_rows(torch, n, args.reps) + torch_rows(torch, n, args.reps)
    if args.adamw_bench:
        doc["zerort"] = run_zerort(args.adamw_bench, sizes)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
