#!/usr/bin/env python3
"""The Hugging Face anchor of k3serve-bench-e2e: transformers' KimiLinearForCausalLM with flash-linear-attention
kernels, bf16, decoding a batch of sequences greedily after a prompt, timed per experts implementation. The
model is built from a config with random weights on the GPU and saved with save_pretrained (safetensors), so
that k3serve-bench-e2e loads the very same checkpoint. Writes

    {"device", "torch", "transformers", "fla", "fla_kernels": {hf function: fla implementation},
     "config": {...}, "results": {impl: {"tok_s", "ms_step", "steps"}}, "model_dir"}

    PYTHONPATH=.fla python3 engine/cuda/anchors/hf_e2e_anchor.py --out-model /tmp/kl --json hf.json

The default shapes are the Kimi-Linear-48B layer shapes with 4 layers (3 KDA + 1 MLA, the first one dense),
as in DESIGN §7. Weights are drawn the way k3serve-mkmodel draws them (projections with variance 1/fan_in,
norm weights near 1, KDA A_log / dt_bias in the trained range, a small router bias), so that routing spreads
over the experts as a trained model's does.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../kernels/cuda/anchors"))
from fla_package import import_fla_package  # noqa: E402


def import_fla():
    # The KDA ops are also set on the package itself: transformers resolves `fla.chunk_kda` when it imports the
    # Kimi-Linear modeling file, and takes its torch fallbacks if that fails.
    pkg = import_fla_package()
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    pkg.chunk_kda = chunk_kda
    pkg.fused_recurrent_kda = fused_recurrent_kda
    return pkg.__version__


def fla_kernels(module):
    """HF functions of the modeling module that resolved to an fla implementation (read off their closures)."""
    found = {}
    for name, fn in vars(module).items():
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            mod = getattr(v, "__module__", "") or ""
            if callable(v) and mod.startswith("fla"):
                found[name] = f"{mod}.{getattr(v, '__name__', '?')}"
    return found


def kimi_linear_config(base_path, args):
    cfg = json.load(open(base_path))
    # Derived keys: transformers recomputes them from the ones set below.
    for k in ("architectures", "transformers_version", "dtype", "head_dim", "qk_head_dim", "linear_conv_kernel_dim",
              "linear_head_dim", "linear_num_heads", "layer_types", "mlp_layer_types", "model_type"):
        cfg.pop(k, None)
    cfg.update(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.dense_intermediate,
        num_hidden_layers=4, first_k_dense_replace=1,
        linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128,
                            "num_heads": args.kda_heads, "short_conv_kernel_size": 4},
        num_attention_heads=32, num_key_value_heads=32, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=args.experts, num_experts_per_token=args.top_k, num_shared_experts=1,
        moe_intermediate_size=args.expert_intermediate, routed_scaling_factor=2.446, moe_renormalize=True,
        num_expert_group=1, topk_group=1, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )
    return cfg


@torch.no_grad()
def randomize(model, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(p):
        return torch.rand(p.shape, generator=gen, device=p.device, dtype=torch.float32)

    def randn(p):
        return torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            v = torch.log(1 + 15 * rand(p))
        elif name.endswith("dt_bias"):
            v = torch.log(torch.expm1(torch.exp(math.log(1e-3) + rand(p) * math.log(100.0))))
        elif "conv" in name:
            v = (2 * rand(p) - 1) / math.sqrt(p.shape[-1])
        elif "embed" in name:
            v = randn(p)
        elif p.dim() == 1:  # RMSNorm weights
            v = 0.9 + 0.2 * rand(p)
        else:  # projections, stacked experts included: variance 1/fan_in
            v = randn(p) / math.sqrt(p.shape[-1])
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.copy_((0.2 * rand(b) - 0.1).to(b.dtype))


@torch.no_grad()
def time_decode(model, impl, batch, prompt, warmup, steps, vocab, seed):
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt), generator=gen, device="cuda")
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    pkv = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)

    def step(nxt, pkv):
        out = model(input_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values

    for _ in range(warmup):
        nxt, pkv = step(nxt, pkv)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt, pkv = step(nxt, pkv)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return {"tok_s": batch / dt, "ms_step": dt * 1e3, "steps": steps, "prefill_s": prefill_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-model", required=True, help="save_pretrained directory")
    ap.add_argument("--json", required=True)
    ap.add_argument("--base-config", default="tests/data/tiny-kimi-linear/config.json")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--impls", default="grouped_mm,eager", help="empty: only build and save the checkpoint")
    ap.add_argument("--hidden", type=int, default=2304)
    ap.add_argument("--dense-intermediate", type=int, default=9216)
    ap.add_argument("--kda-heads", type=int, default=32)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=163840)
    args = ap.parse_args()

    fla_version = import_fla()
    import transformers
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "fla": fla_version,
              "fla_kernels": fla_kernels(modeling_kimi_linear), "batch": args.batch, "prompt": args.prompt,
              "results": {}, "errors": {}, "model_dir": args.out_model}
    print("fla kernels in use:", result["fla_kernels"] or "NONE (torch fallbacks)", flush=True)

    def save():  # after every stage: a run cut short keeps what it measured
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    cfg = kimi_linear_config(args.base_config, args)
    config = KimiLinearConfig.from_dict(cfg)
    result["config"] = cfg
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = KimiLinearForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.eval()
    randomize(model, 0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built {n_params / 1e9:.2f}B parameters on the GPU in {time.perf_counter() - t0:.1f} s", flush=True)
    save()

    for impl in [i for i in args.impls.split(",") if i]:
        try:
            steps = args.steps if impl != "eager" else max(4, args.steps // 4)
            r = time_decode(model, impl, args.batch, args.prompt, args.warmup, steps, args.vocab, 1)
            result["results"][impl] = r
            print(f"{impl}: {r['tok_s']:.0f} tok/s, {r['ms_step']:.2f} ms/step (prefill {r['prefill_s']:.1f} s)",
                  flush=True)
        except Exception as e:  # noqa: BLE001 — record and go on with the other implementation
            result["errors"][impl] = repr(e)
            print(f"{impl}: {e!r}", flush=True)
        save()

    t0 = time.perf_counter()
    model.save_pretrained(args.out_model)
    print(f"saved to {args.out_model} in {time.perf_counter() - t0:.1f} s", flush=True)
    with open(os.path.join(args.out_model, "config.json")) as f:
        result["saved_config_keys"] = sorted(json.load(f).keys())
    save()


if __name__ == "__main__":
    main()
