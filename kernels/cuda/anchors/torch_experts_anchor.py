#!/usr/bin/env python3
"""Times torch at the MoE shapes of k3serve-bench-kernels and writes the median times as JSON for
`k3serve-bench-kernels --torch-anchors`:

    {"device": ..., "torch": ..., "times_ms": {case: ms}, "errors": {case: message}}

experts_avg{T}: the routed experts at K3 latent shapes (ℓ 3584, I 3072, 56 experts on one GPU), bf16, with T
tokens for EVERY expert (the best case for torch; the bench routes Zipf-skewed tokens with the same average):
three torch.bmm, g = x W1ᵀ, u = x W3ᵀ, y = h W2ᵀ, weights in their PyTorch Linear layout [E, out, in].
Only the three products are timed (h is computed once outside), so the anchor is the GEMMs alone.

router_n{N}: the sigmoid router on fp32 logits [N, 896], k = 16: sigmoid, + bias, topk, gather of the unbiased
scores, renormalize, scale.

    python3 kernels/cuda/anchors/torch_experts_anchor.py --out torch.json
"""
import argparse
import json
import sys
import time
import traceback

import torch
import triton


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args()

    gen = torch.Generator(device="cuda").manual_seed(0)
    times, errors = {}, {}

    def save():  # after every case: a run cut short still leaves the cases it finished
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "times_ms": times, "errors": errors}, f, indent=2)

    def bench(name, fn):
        start = time.time()
        try:
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms, return_mode="median")
            times[name] = ms
            print(f"{name:24s} {ms * 1e3:10.1f} us   ({time.time() - start:.0f} s)", flush=True)
        except Exception as e:  # keep the other cases
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"
        save()

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (scale * torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)).to(dtype)

    with torch.inference_mode():
        E, D, I = 56, 3584, 3072
        w1, w3 = randn(E, I, D, scale=0.02), randn(E, I, D, scale=0.02)
        w2 = randn(E, D, I, scale=0.02)
        for T in (8, 16, 32, 64, 128, 256, 512):
            x = randn(E, T, D)
            h = randn(E, T, I)
            g = torch.empty(E, T, I, device="cuda", dtype=torch.bfloat16)
            u = torch.empty_like(g)
            y = torch.empty(E, T, D, device="cuda", dtype=torch.bfloat16)

            def experts():
                torch.bmm(x, w1.transpose(1, 2), out=g)
                torch.bmm(x, w3.transpose(1, 2), out=u)
                torch.bmm(h, w2.transpose(1, 2), out=y)

            bench(f"experts_avg{T}", experts)
            del x, h, g, u, y
        del w1, w2, w3

        E, k, scale = 896, 16, 2.5
        bias = randn(E, scale=0.05, dtype=torch.float32)
        for N in (64, 8192):
            logits = randn(N, E, dtype=torch.float32)

            def router():
                s = torch.sigmoid(logits)
                idx = torch.topk(s + bias, k, dim=-1).indices
                w = s.gather(1, idx)
                return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale

            bench(f"router_n{N}", router)

    return 0 if times else 1


if __name__ == "__main__":
    sys.exit(main())
