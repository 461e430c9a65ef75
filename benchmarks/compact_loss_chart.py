#!/usr/bin/python3
"""Held-out loss of the GPT demo for the fp32 master and each compact optimizer-state form.

    bazel build -c opt //cli:zerort
    /usr/bin/python3 benchmarks/compact_loss_chart.py bazel-bin/cli/zerort docs/data docs/img

(/usr/bin/python3: Debian's interpreter, the one python3-matplotlib installs into.)

Trains the same model from the same seed once per form (docs/compact_state.md), with the
same data, steps and evaluation windows, and writes compact_loss.csv (step, then train and
held-out loss per form) and compact_loss.png (held-out loss against step, one line per form;
below it the gap to the fp32 master). Every gap, the lossless form's included (its bf16 parameter
rounds ties away from zero), is printed, not asserted: numerics shown, not promised.

Options (after the three paths): --steps N (300), --eval-every N (10), and any further
`zerort demo` flags, e.g. --layers 2 --d_model 128 --ranks 2 (the defaults below).
"""
import csv
import json
import os
import subprocess
import sys
import tempfile

BASE = {
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0006, "weight_decay": 0.1}},
    "gradient_clipping": 1.0,
}

# (label, changes to BASE)
FORMS = [
    ("fp32 master, fp32 moments", {}),
    ("bf16 + remainder master (lossless)", {"zerort": {"store_param_remainders": True}}),
    ("fp32 master, bf16 moments", {"bf16": {"enabled": True, "bf16_optimizer_states": True}}),
    ("stochastic bf16 master", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                                "zerort": {"stochastic_rounding_seed": 1234}}),
    ("stochastic bf16 master, bf16 moments",
     {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
               "bf16_optimizer_states": True},
      "zerort": {"stochastic_rounding_seed": 1234}}),
]

def merged(base, change):
    out = json.loads(json.dumps(base))
    for k, v in change.items():
        if isinstance(v, dict):
            out.setdefault(k, {}).update(v)
        else:
            out[k] = v
    return out


def run(zerort, config, steps, eval_every, extra):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
        path = f.name
    try:
        cmd = [zerort, "demo", "--config", path, "--steps", str(steps), "--eval_every",
               str(eval_every)] + extra
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    train, val = {}, {}
    in_table = False
    for line in out.splitlines():
        # "  step      loss  val_loss  grad_norm ...", then a row per step (val_loss only on
        # evaluation steps) up to a blank line.
        cells = line.split()
        if cells[:3] == ["step", "loss", "val_loss"]:
            in_table = True
            continue
        if not cells:
            in_table = False
        if not in_table or len(cells) < 5 or not cells[0].isdigit():
            continue
        step = int(cells[0])
        train[step] = float(cells[1])
        if len(cells) >= 6:
            val[step] = float(cells[2])
    if not val:
        raise SystemExit("no held-out losses in the demo's output:\n" + out)
    return train, val


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    zerort, data_dir, img_dir = sys.argv[1:4]
    args = sys.argv[4:]
    steps, eval_every = 300, 10
    extra = []
    i = 0
    while i < len(args):
        if args[i] == "--steps":
            steps = int(args[i + 1])
            i += 2
        elif args[i] == "--eval-every":
            eval_every = int(args[i + 1])
            i += 2
        else:
            extra.append(args[i])
            i += 1
    if not extra:
        extra = ["--layers", "2", "--d_model", "128", "--ranks", "2"]
    runs = []
    for label, change in FORMS:
        print("training:", label, file=sys.stderr)
        runs.append((label,) + run(zerort, merged(BASE, change), steps, eval_every, extra))
    ref_val = runs[0][2]
    # The lossless master equals the fp32 master given the same gradients, but its bf16
    # parameter rounds exact ties away from zero (docs/compact_state.md), so the forward pass,
    # and from then on everything, may differ by an ulp now and then: shown, not asserted.
    same = sum(runs[1][2][s] == ref_val[s] for s in ref_val)
    print(f"lossless: {same} of {len(ref_val)} held-out losses equal the fp32 master's exactly")
    steps_seen = sorted(ref_val)
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "compact_loss.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"{lab} {kind}" for lab, _, _ in runs for kind in ("train", "val")])
        for s in sorted(runs[0][1]):
            row = [s]
            for _, train, val in runs:
                row += [train.get(s, ""), val.get(s, "")]
            w.writerow(row)
    last = steps_seen[-1]
    for lab, _, val in runs:
        tail = [val[s] for s in steps_seen[-5:]]
        ref_tail = [ref_val[s] for s in steps_seen[-5:]]
        gap = sum(tail) / len(tail) - sum(ref_tail) / len(ref_tail)
        print(f"{lab}: held-out loss at step {last} {val[last]:.4f} nats/byte; mean of the last "
              f"5 evaluations {sum(tail) / len(tail):.4f}, gap to fp32 {gap:+.4f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    styles = ["-", "--", "-", "-", "-"]
    for (lab, _, val), style in zip(runs, styles):
        top.plot(steps_seen, [val[s] for s in steps_seen], style, label=lab)
        bottom.plot(steps_seen, [val[s] - ref_val[s] for s in steps_seen], style, label=lab)
    top.set_ylabel("held-out loss (nats per byte)")
    top.legend()
    top.set_title("GPT demo, held-out loss per optimizer-state form (" + " ".join(extra) + ")")
    bottom.axhline(0, color="grey", linewidth=0.5)
    bottom.set_ylabel("minus fp32 master")
    bottom.set_xlabel("step")
    fig.tight_layout()
    os.makedirs(img_dir, exist_ok=True)
    fig.savefig(os.path.join(img_dir, "compact_loss.png"), dpi=110)


if __name__ == "__main__":
    main()
