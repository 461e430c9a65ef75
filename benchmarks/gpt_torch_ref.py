#!/usr/bin/env python3
"""The example GPT (examples/gpt) in PyTorch: the reference `zerort demo --device cuda` is
compared with, on the same shapes, batch and sequence length.

The model is examples/gpt's: token and position embeddings, pre-LayerNorm blocks (eps 1e-5) of
causal multi-head self-attention and a GELU (tanh approximation) MLP, a final LayerNorm and an
output projection tied to the token embedding; GPT-2's initialisation (N(0, 0.02), residual
projections scaled by 1/sqrt(2 L), LayerNorm gains 1, biases 0). Defaults are the demo's GPU
defaults: GPT-2 124M's shapes (12 layers, 12 heads, d_model 768, context 1024) with the byte
vocabulary (256), 8 sequences of 1024 tokens, lr 6e-4, weight decay 0.1, clipping 1.0.

Training is eager PyTorch with bf16 autocast (fp32 weights, as zerort's fp32 masters) and
torch.optim.AdamW(fused=True); attention is written out (q k^T, causal mask, softmax, att v) as
zerort computes it, or with --sdpa torch's scaled_dot_product_attention (flash attention), to
show what a fused attention buys. Tokens are random bytes (throughput does not depend on them)
unless --corpus names a file.

Prints one JSON document: tokens per second (median over the timed steps, CUDA events around
forward + backward + clipping + step), the model FLOPs per token as zerort counts them
(6 N + 6 L d T) and the MFU against --peak_tflops if given. Without torch's CUDA it prints
{"benchmark": "gpt_torch_ref", "skipped": "<reason>"} and exits 0.

Usage: gpt_torch_ref.py [--layers 12] [--heads 12] [--d_model 768] [--context 1024]
                        [--vocab 256] [--batch 8] [--seq 1024] [--steps 20] [--warmup 3]
                        [--precision bf16|fp32] [--sdpa] [--corpus FILE] [--peak_tflops X]
Run on a lent GPU machine with /opt/torch/.venv/bin/python.
"""
import argparse
import json
import math
import statistics
import sys


def build_model(torch, args):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.d_model
            self.ln1 = nn.LayerNorm(d, eps=1e-5)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d, eps=1e-5)
            self.fc = nn.Linear(d, 4 * d)
            self.mlp_proj = nn.Linear(4 * d, d)

        def attention(self, x):
            b, t, d = x.shape
            h, hs = args.heads, d // args.heads
            q, k, v = self.qkv(x).split(d, dim=2)
            q = q.view(b, t, h, hs).transpose(1, 2)
            k = k.view(b, t, h, hs).transpose(1, 2)
            v = v.view(b, t, h, hs).transpose(1, 2)
            if args.sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
                mask = torch.ones(t, t, device=x.device, dtype=torch.bool).tril()
                att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
                y = att @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(args.vocab, args.d_model)
            self.wpe = nn.Embedding(args.context, args.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(args.d_model, eps=1e-5)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif "ln" in name:
                    nn.init.ones_(p)
                else:
                    std = 0.02
                    if name.endswith("proj.weight"):  # proj and mlp_proj: residual projections
                        std /= math.sqrt(2 * args.layers)
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied output projection
            return F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1))

    return Gpt()


def batches(torch, args, device):
    """An endless supply of (inputs, targets): windows of --corpus, or random bytes."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = None
    if args.corpus:
        with open(args.corpus, "rb") as f:
            data = torch.tensor(list(f.read()), dtype=torch.long)
    while True:
        if data is None:
            rows = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        else:
            starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
            rows = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
        rows = rows.to(device, non_blocking=True)
        yield rows[:, :-1], rows[:, 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=0, help="tokens per sequence; 0 = context")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--sdpa", action="store_true", help="fused attention instead of explicit")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--corpus", default="", help="train on this file's bytes")
    parser.add_argument("--peak_tflops", type=float, default=0.0,
                        help="peak of the GPU for MFU (H100/H200 SXM bf16 dense: 989)")
    args = parser.parse_args()
    args.seq = args.seq or args.context
    result = {"benchmark": "gpt_torch_ref"}
    try:
        import torch
    except ImportError as e:
        result["skipped"] = f"no torch: {e}"
        print(json.dumps(result))
        return 0
    if not torch.cuda.is_available():
        result["skipped"] = "torch.cuda.is_available() is False"
        print(json.dumps(result))
        return 0
    device = torch.device("cuda")
    torch.manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # as zerort's fp32 path
    torch.backends.cudnn.allow_tf32 = False
    model = build_model(torch, args).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # zerort's demo applies weight decay to every parameter unless groups say otherwise; torch's
    # usual recipe exempts biases and gains. Both are one fused kernel per group: same cost.
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    data = batches(torch, args, device)

    def step():
        x, y = next(data)
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    losses = []
    for _ in range(args.warmup):
        losses.append(step().item())
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(args.steps):
        start.record()
        loss = step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
        losses.append(loss.item())
    tokens = args.batch * args.seq
    median = statistics.median(times)
    flops_per_token = 6 * params + 6 * args.layers * args.d_model * args.seq
    result.update({
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"layers": args.layers, "heads": args.heads, "d_model": args.d_model,
                  "context": args.context, "vocab": args.vocab},
        "parameters": params,
        "batch": args.batch,
        "seq": args.seq,
        "precision": args.precision,
        "attention": "sdpa" if args.sdpa else "explicit",
        "optimizer": "torch.optim.AdamW(fused=True)",
        "steps_timed": args.steps,
        "step_s_median": median,
        "step_s_best": min(times),
        "tokens_per_s": tokens / median,
        "model_flops_per_token": flops_per_token,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
    })
    if args.peak_tflops > 0:
        result["peak_tflops"] = args.peak_tflops
        result["mfu"] = tokens / median * flops_per_token / (args.peak_tflops * 1e12)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
