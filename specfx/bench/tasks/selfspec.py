"""``specfx bench selfspec``: specfx early exit and MTP heads against HF's equivalents, one run.

Run ``specfx bench selfspec --help`` for the flags. Per family, on the same
prompts (batch 1, one after another), the same number of new tokens, greedy, fp32:

  early_exit   target: ``--target`` (a causal LM directory; default the demo pair's target) or
               ``random`` (a random 6-layer llama: α meaningless)
      hf_dynamic              target.generate()                                  (baseline, 1.00x)
      hf_early_exit_n{N}      target.generate(assistant_early_exit=N), K constant draft tokens a
                              round (num_assistant_tokens=K, schedule "constant", threshold 0, set
                              on the target's generation_config, which HF reads for its assistant,
                              during each call only: :func:`specfx.bench.harness.hf_assisted`)
      specfx_early_exit_n{N}  specfx.speculate(target, draft="early_exit:N", num_speculative_tokens=K)
  mtp          target: ``--mtp-target`` (a checkpoint directory with MTP weights) or ``random``
               (default: a random Mellum-shaped MoE model with one random MTP layer, written to a
               temporary checkpoint so that HF can load its MTP layer too; α meaningless)
      hf_dynamic              target.generate()                                  (baseline, 1.00x)
      hf_mtp                  target.generate(use_mtp=True): HF drafts one token per MTP layer
      specfx_mtp_k{K}         specfx.speculate(target, draft="mtp", num_speculative_tokens=K), for
                              K = the number of MTP layers (HF's K) and ``--ks`` (chained beyond it)

Prompts: functions from the stdlib files the demo pair holds out of training (the first lines
of each, the "complete" task of :mod:`specfx.bench.stdlib_code`); a random target reads them as UTF-8 bytes.
Timing, warm-up (graphs compile there) and the token-for-token check against hf_dynamic are
:func:`specfx.bench.harness.bench_end_to_end`'s; the command exits with status 1 if an output differs.

Acceptance, from an untimed pass: a forward pre-hook on the target's *last decoder layer*
counts full-depth target forwards (HF's early-exit drafts stop before that layer, MTP layers
are other modules) and the tokens each one is fed. For every method: τ = new tokens / target
forwards (prefill included), fwd/tok = its inverse; α = accepted / proposed, from
``spec.stats`` for specfx and, for HF, proposed = tokens fed beyond the pending one (beyond the
prompt for the first forward), accepted = new tokens - forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from specfx.bench.counters import hf_forwards
from specfx.bench.harness import (
    BASELINE,
    NO_EOS,
    add_run_options,
    bench_end_to_end,
    hf_assisted,
    log,
    n_params,
    run_meta,
    torch_threads,
)
from specfx.bench.stdlib_code import default_target, load_target, pick_functions, task_prompt
from specfx.model.capture import decoder_layer_names

__all__ = ["main", "parse_args", "random_mtp_checkpoint"]

DESCRIPTION = (
    "Self-speculation: specfx early exit against HF's assistant_early_exit, and specfx MTP heads\n"
    "against HF's use_mtp (tokens/s, τ, α, in one run)."
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specfx bench selfspec", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--families", nargs="+", default=["early_exit", "mtp"], choices=("early_exit", "mtp"))
    p.add_argument(
        "--target",
        default=default_target(),
        help="early-exit target: a local model directory (safetensors) or 'random' (default: the demo pair's target)",
    )
    p.add_argument(
        "--mtp-target",
        default="random",
        help="MTP target: a local checkpoint directory with MTP weights (safetensors), or 'random'",
    )
    p.add_argument("--exit-layers", type=int, nargs="+", default=[2], help="N of early_exit:N")
    p.add_argument("--k", type=int, default=4, help="K of the early-exit methods (HF and specfx)")
    p.add_argument("--ks", type=int, nargs="+", default=[3], help="extra K values of specfx MTP (chained layers)")
    p.add_argument("--num-prompts", type=int, default=4)
    add_run_options(p, "selfspec.json")
    args = p.parse_args(argv)
    args.command = "specfx bench selfspec " + " ".join(sys.argv[3:] if argv is None else argv)
    if min(args.k, args.num_prompts, args.max_new_tokens, args.repeats, args.threads, *args.ks, *args.exit_layers) < 1:
        p.error("--k, --ks, --exit-layers, --num-prompts, --max-new-tokens, --repeats and --threads must be >= 1")
    return args


# ----------------------------------------------------------------------------- targets
def random_mtp_checkpoint(directory: str):
    """A random Mellum-shaped MoE target with one random MTP layer, saved with its MTP weights
    (under ``mtp.``, where transformers' MtpModel.from_pretrained looks) and loaded back."""

    from specfx.drafters.mtp import random_mtp_layers, save_with_mtp_layers
    from specfx.model.load import load_causal_lm
    from specfx.testing.tiny import tiny_causal_lm

    model = tiny_causal_lm(
        "mellum", vocab_size=512, num_layers=6, hidden_size=256, intermediate_size=704, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, moe_intermediate_size=256, max_positions=2048, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 3, num_mtp_layers=1, initializer_range=0.02,
    )  # fmt: skip
    save_with_mtp_layers(model, random_mtp_layers(model, 1, std=0.02, seed=1), directory)
    return load_causal_lm(directory, torch.float32, attn_implementation="sdpa")


def load_mtp_target(spec: str, tmp: str):
    """(target, encode, description)."""
    if spec == "random":
        desc = "random Mellum-shaped MoE (6 layers, 4 experts) + 1 random MTP layer over UTF-8 bytes (α meaningless)"
        return random_mtp_checkpoint(tmp), lambda s: list(s.encode("utf-8")), desc
    return load_target(spec)


# ----------------------------------------------------------------------------- methods
def hf_early_exit(target, layer: int, k: int, ids, common: dict):
    """HF's early exit with K constant proposals (HF reads K from the target's own
    generation_config: set for this call only)."""
    with hf_assisted(target, f"early_exit:{layer}", k) as assisted:
        return target.generate(ids, attention_mask=torch.ones_like(ids), **assisted, **common)


def early_exit_methods(args, target, bucket: int, common: dict):
    import specfx

    methods = {BASELINE: lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common)}
    specs = {}
    options = dict(prefill_buckets=(bucket,), compile=not args.no_compile, num_speculative_tokens=args.k)
    for layer in args.exit_layers:
        methods[f"hf_early_exit_n{layer}"] = lambda ids, layer=layer: hf_early_exit(target, layer, args.k, ids, common)
        specs[f"specfx_early_exit_n{layer}"] = specfx.speculate(target, draft=f"early_exit:{layer}", **options)
    for name, spec in specs.items():
        methods[name] = lambda ids, spec=spec: spec.generate(ids, **common)
    return methods, specs


def mtp_methods(args, target, bucket: int, common: dict):
    import specfx

    methods = {
        BASELINE: lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common),
        "hf_mtp": lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), use_mtp=True, **common),
    }
    depth = target.config.get_text_config().num_mtp_layers
    options = dict(prefill_buckets=(bucket,), compile=not args.no_compile)
    specs = {
        f"specfx_mtp_k{k}": specfx.speculate(target, draft="mtp", num_speculative_tokens=k, **options)
        for k in sorted({depth, *args.ks})
    }
    for name, spec in specs.items():
        methods[name] = lambda ids, spec=spec: spec.generate(ids, **common)
    return methods, specs


# ----------------------------------------------------------------------------- acceptance
def acceptance(args, methods, specs, target, prompts) -> dict:
    out = {}
    new = args.max_new_tokens * len(prompts)
    for name, fn in methods.items():
        if name in specs:
            proposed = accepted = forwards = 0
            for p in prompts:
                fn(p)
                s = specs[name].stats
                proposed, accepted, forwards = proposed + s.proposed, accepted + s.accepted, forwards + s.rounds + 1
        else:
            last_layer = target.get_submodule(decoder_layer_names(target)[-1])  # full-depth forwards only
            forwards, proposed = hf_forwards(fn, last_layer, prompts)
            accepted = new - forwards
        out[name] = dict(
            alpha=accepted / proposed if proposed else None, tau=new / forwards, forwards_per_token=forwards / new
        )
    return out


def print_family(family: str, results: dict, acc: dict) -> None:
    print(f"\n## {family}\n")
    print("| method | tokens/s | vs HF greedy | vs HF's equivalent | τ | α | fwd/tok | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        if res["status"] != "ok":
            print(f"| {name} | failed: {res['reason'][:80]} | | | | | | |")
            continue
        a = acc[name]
        peer = {"specfx_early_exit": "hf_early_exit", "specfx_mtp": "hf_mtp"}
        peer_name = next((p for s, p in peer.items() if name.startswith(s)), None)
        if peer_name == "hf_early_exit":
            peer_name = name.replace("specfx_", "hf_")
        p = results.get(peer_name) if peer_name else None
        vs_peer = f"{p['median_s'] / res['median_s']:.2f}x" if p and p["status"] == "ok" else ""
        alpha = f"{a['alpha']:.2f}" if a["alpha"] is not None else "-"
        print(
            f"| {name} | {res['tokens_per_s']:.1f} | {res.get('speedup_vs_hf_dynamic', float('nan')):.2f}x | "
            f"{vs_peer} | {a['tau']:.2f} | {alpha} | {a['forwards_per_token']:.2f} | "
            f"{'yes' if res['same_tokens_as_hf_dynamic'] else 'NO'} |"
        )


def main(argv=None) -> int:
    """``specfx bench selfspec``: returns 0, or 1 if a method's tokens differ from HF greedy."""
    args = parse_args(argv)
    with torch_threads(args.threads):
        try:
            return run(args)
        except ValueError as e:  # a bad --target/--mtp-target (checked before loading)
            raise SystemExit(f"specfx bench selfspec: error: {e}") from None


def run(args) -> int:
    print(f"specfx bench selfspec: float32, {torch.get_num_threads()} torch thread(s)", flush=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    report, failed, meta = {}, False, {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            if family == "early_exit":
                target, encode, desc = load_target(args.target)
            else:
                target, encode, desc = load_mtp_target(args.mtp_target, tmp)
            pad = target.generation_config.pad_token_id
            # every method generates exactly max_new_tokens; set per call, the model is not changed
            common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad or 0, **NO_EOS)
            picked, _ = pick_functions(encode, args.fn_tokens, args.num_prompts, args.seed)
            prompts = [torch.tensor([encode(task_prompt("complete", name, src))]) for _, name, src in picked]
            bucket = -(-max(p.shape[1] for p in prompts) // 64) * 64
            log(f"[{family}] target: {desc}; prompts {[p.shape[1] for p in prompts]} tokens, bucket {bucket}")
            build = early_exit_methods if family == "early_exit" else mtp_methods
            methods, specs = build(args, target, bucket, common)
            results = bench_end_to_end(args, methods, prompts)
            live = {n: m for n, m in methods.items() if results[n]["status"] == "ok"}
            acc = acceptance(args, live, specs, target, prompts)
            print_family(family, results, acc)
            failed |= any(r["status"] == "ok" and not r["same_tokens_as_hf_dynamic"] for r in results.values())
            report[family] = dict(results=results, acceptance=acc)
            meta[family] = dict(
                target=desc,
                target_params=n_params(target),
                functions=[f"{f}:{n}" for f, n, _ in picked],
                prompt_lengths=[p.shape[1] for p in prompts],
            )
            print(f"target: {desc}, {meta[family]['target_params'] / 1e6:.2f} M parameters")
    meta.update(
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        **run_meta(t_start, load_start, args.command),
    )
    print(f"\n{meta['machine']['cpu']}, {meta['machine']['threads']} thread(s); total {meta['wall_s']:.0f} s; "
          f"load average {load_start[0]:.2f} at start, {meta['load_avg']['end'][0]:.2f} at end")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(meta=meta, families=report), indent=1, default=str))
    print(f"wrote {args.json}")
    if failed:
        print("ERROR: some method's tokens differ from HF greedy", file=sys.stderr)
        return 1
    return 0
