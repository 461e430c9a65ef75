#!/usr/bin/env python3
"""torch.optim.AdamW(fused=True) on the sizes cuda_bench measures: the reference our AdamW kernel
is compared with (cuda_bench's "adamw" row with grad f32 and param_out none moves the same 28
bytes per parameter: fp32 param/master, m and v read and written, fp32 grad read).

Each size reports the median of CUDA-event-timed optimizer steps after a warm-up step (which
creates the state), as bytes read + written per second, and `fraction_of_d2d_copy` against a
device-to-device copy of 4n bytes timed the same way in the same run, like cuda_bench.

Prints one JSON document. Without torch's CUDA it prints {"benchmark": "adamw_torch_ref",
"skipped": "<reason>"} and exits 0. tools/gpu_bundle/run.sh runs it with /opt/torch/.venv/bin/python.

Usage: adamw_torch_ref.py [--elements N ...] [--reps R]   (default: 1e8 1e9, 10 reps)
"""
import argparse
import json
import statistics
import sys


def timed(torch, fn, reps):
    """Sorted seconds of each call of fn() between CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)


def bench_size(torch, n, reps):
    free, _ = torch.cuda.mem_get_info()
    need = 6 * 4 * n + (64 << 20)  # param, grad, m, v + the copy's two buffers
    if need > free:
        return {"elements": n, "skipped": f"needs {need >> 20} MiB, {free >> 20} MiB free"}
    src = torch.zeros(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    copy = timed(torch, lambda: dst.copy_(src), reps)
    copy_gbps = 8.0 * n / statistics.median(copy) / 1e9
    del src, dst
    param = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32, device="cuda"))
    param.grad = torch.zeros_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    step = timed(torch, opt.step, reps)
    gbps = 28.0 * n / statistics.median(step) / 1e9
    row = {
        "elements": n,
        "d2d_copy": {"bytes": 4 * n, "median_ms": statistics.median(copy) * 1e3,
                     "gb_per_s": copy_gbps},
        "adamw_fused": {"bytes_per_element": 28, "median_ms": statistics.median(step) * 1e3,
                        "best_ms": step[0] * 1e3, "gb_per_s": gbps,
                        "elements_per_s": n / statistics.median(step),
                        "fraction_of_d2d_copy": gbps / copy_gbps},
    }
    print(f"adamw_torch_ref: n={n}: fused AdamW {row['adamw_fused']['median_ms']:.3f} ms, "
          f"{gbps / copy_gbps:.2f} of d2d copy", file=sys.stderr)
    del opt, param
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", nargs="+", type=float, default=[1e8, 1e9])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    doc = {"benchmark": "adamw_torch_ref"}
    try:
        import torch
    except ImportError as e:
        doc["skipped"] = f"no torch: {e}"
        print(json.dumps(doc, indent=2))
        return 0
    if not torch.cuda.is_available():
        doc["skipped"] = "torch.cuda.is_available() is False"
        print(json.dumps(doc, indent=2))
        return 0
    doc["torch"] = torch.__version__
    doc["device"] = torch.cuda.get_device_name(0)
    doc["compare_with"] = "cuda_bench kernels: adamw grad f32, param_out none (28 bytes/element)"
    doc["sizes"] = [bench_size(torch, int(n), args.reps) for n in args.elements]
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
