#!/usr/bin/env python3
"""Times flash-linear-attention's KDA kernels at the shapes of k3serve-bench-kernels and writes their median
times as JSON for `k3serve-bench-kernels --anchors`:

    {"device": ..., "torch": ..., "triton": ..., "times_ms": {case: ms}, "errors": {case: message}}

Same work as ours: bf16 q, k, v, raw gate and β logits; the gate (A_log, dt_bias), the q/k L2 norm and the
β sigmoid fused in the kernel; fp32 state. Decode updates a state pool in place through state indices
(the vLLM path, fused_recurrent_kda_fwd); prefill is chunk_kda over one sequence of T tokens from a zero
state, final state out. Inputs are drawn as the bench draws them (the trained-model range of the gate).

    PYTHONPATH=.fla python3 kernels/cuda/anchors/fla_kda_anchor.py --out fla.json
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import triton

from fla_package import import_fla_package  # beside this script


def import_fla_kda():
    import_fla_package()
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    return chunk_kda, fused_recurrent_kda_fwd


def kda_inputs(T, H, D, gen):
    dev = "cuda"
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
    q, k, v, g = (randn(T, H, D) for _ in range(4))
    b = randn(T, H)
    A_log = torch.log(1 + 15 * torch.rand(H, generator=gen, device=dev))
    dt = torch.exp(math.log(1e-3) + torch.rand(H * D, generator=gen, device=dev) * math.log(100.0))
    dt_bias = torch.log(torch.expm1(dt))
    return q, k, v, g, b, A_log.float(), dt_bias.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args()

    chunk_kda, fused_recurrent_kda_fwd = import_fla_kda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    times, errors = {}, {}

    def save():  # after every case: a run cut short still leaves the cases it finished
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "fla": sys.modules["fla"].__version__,
            "times_ms": times,
            "errors": errors,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    def bench(name, fn):
        start = time.time()
        try:
            fn()  # compiles and autotunes
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms, return_mode="median")
            times[name] = ms
            print(f"{name:28s} {ms * 1e3:10.1f} us   ({time.time() - start:.0f} s with compile and autotune)",
                  flush=True)
        except Exception as e:  # keep the other cases
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"
        save()

    with torch.inference_mode():
        H, D = 96, 128
        for N in (64, 256):
            q, k, v, g, b, A_log, dt_bias = kda_inputs(N, H, D, gen)
            shape = lambda x: x.view(N, 1, *x.shape[1:])  # B = N sequences of one token
            q, k, v, g, b = map(shape, (q, k, v, g, b))
            pool = 0.3 * torch.randn(N, H, D, D, generator=gen, device="cuda")
            idx = torch.arange(N, device="cuda", dtype=torch.int32)
            out = torch.empty_like(v)
            bench(f"decode_n{N}_h96", lambda: fused_recurrent_kda_fwd(
                q=q, k=k, v=v, g=g, beta=b, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, out=out))
            del q, k, v, g, b, pool, out

        T = 8192
        for gate in ("softplus", "bounded"):
            for H in (32, 96):
                q, k, v, g, b, A_log, dt_bias = kda_inputs(T, H, D, gen)
                q, k, v, g, b = (x.unsqueeze(0) for x in (q, k, v, g, b))
                extra = dict(lower_bound=-5.0, safe_gate=True) if gate == "bounded" else {}
                bench(f"prefill_t8192_h{H}_{gate}", lambda: chunk_kda(
                    q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True, **extra))
                del q, k, v, g, b

    return 0 if times else 1


if __name__ == "__main__":
    sys.exit(main())
