"""DeepSeek-V4's compressed-KV attention through specfx against HF generate() (issue 29, decision 97).

A random DeepSeek-V4-style model (54 M parameters: 6 layers, 4 heavily compressed (windows of 128), 2
compressed sparse (windows of 4, an indexer's top-64), a sliding window of 128, hyper-connections of 4
streams), one prompt of random tokens per context, greedy. Per method: milliseconds per decoded token
(the LONG - SHORT tokens after the first SHORT: two calls' difference, so the prefill cancels), then the
first call's prefill + SHORT tokens. Every method's output equals HF's (asserted). The model is random,
so prompt lookup's proposals are rejected (α ≈ 0): its row is what a K = 4 round costs, and "auto" is
what specfx does when speculation does not pay.

    python benchmarks/deepseek_v4.py                # eager rounds (compile=False)
    python benchmarks/deepseek_v4.py --compile      # Inductor rounds, compiled in the foreground first

Prints ratios against HF in one run; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import specfx


def model():
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    torch.manual_seed(0)
    config = DeepseekV4Config(
        vocab_size=4096,
        hidden_size=512,
        moe_intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        head_dim=128,
        q_lora_rank=256,
        num_experts_per_tok=2,
        n_routed_experts=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=128,
        o_groups=4,
        o_lora_rank=128,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=64,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="Inductor rounds (default: eager)")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=72)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = model()
    print(
        f"# {' '.join(sys.argv)}; torch {torch.__version__}, threads {args.threads}, load {os.getloadavg()[0]:.2f}; "
        f"{sum(p.numel() for p in m.parameters()) / 1e6:.1f} M parameters, layer types {m.config.layer_types}"
    )
    options = dict(backend="specfx", background_compile=False) if args.compile else dict(compile=False)
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(3, m.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        per_token, first, ref = {}, {}, None
        for name in ("HF generate()", "specfx auto", "specfx prompt lookup K=4"):
            if name.startswith("HF"):
                call = m.generate
            else:
                k = "auto" if "auto" in name else 4
                call = specfx.speculate(m, draft="prompt_lookup", num_speculative_tokens=k, **options).generate
            times = {}
            for new in (args.long, args.short, args.long):  # the first call warms up (and compiles)
                start = time.perf_counter()
                out = call(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)
                times[new] = time.perf_counter() - start
            ref = out if ref is None else ref
            assert torch.equal(out, ref), f"{name} differs from HF"
            per_token[name] = (times[args.long] - times[args.short]) * 1000 / (args.long - args.short)
            first[name] = times[args.short] * 1000
        hf = per_token["HF generate()"]
        print(f"context {ctx}: ms per decoded token, and against HF")
        for name, ms in per_token.items():
            print(
                f"  {name:26s} {ms:7.1f} ms  {hf / ms:5.2f}x   (prefill + {args.short} tokens: {first[name]:6.0f} ms)"
            )


if __name__ == "__main__":
    with torch.no_grad():
        main()
