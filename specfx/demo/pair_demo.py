"""``specfx demo --pair``: the shipped 4M-parameter demo pair (:mod:`specfx.demo.pair`) completes
held-out code prompts; HF ``generate()``, HF assisted generation and specfx are timed on the same
prompts, specfx's greedy output is checked against HF's, and a plot is written. For people
without SmolLM2-135M-Instruct (the default demo, :mod:`specfx.demo.chat`) and for tests.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from specfx.demo.stream import ACCEPTED_OFF, ACCEPTED_ON, PLAIN_OFF, PLAIN_ON, MarkingStreamer, render_marked

__all__ = ["run_pair", "assisted", "head_params", "PAIR_DEFAULTS"]

# the pair's defaults for the options the chat demo defaults differently (cli.py: None = this)
PAIR_DEFAULTS = {
    "k": 4,
    "draft": "draft",
    "max_new_tokens": 64,
    "num_prompts": 3,
    "temperature": 0.8,
    "plot": Path("specfx_demo.png"),
}


def assisted(target, draft, k: int, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """HF assisted generation with K constant proposals; the draft's generation_config is
    changed for this call only."""
    from specfx.bench.harness import hf_assisted

    with hf_assisted(target, draft, k) as kw:
        return target.generate(ids, **kw, **kwargs)


def head_params(path: Path) -> int:
    """Parameters stored in a head directory's safetensors files: its floating-point tensors
    (EAGLE-3's integer/boolean vocabulary maps are not parameters)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                t = st.get_slice(key)
                n += math.prod(t.get_shape()) if t.get_dtype() in ("F16", "BF16", "F32", "F64") else 0
    return n


def run_pair(args) -> int:
    """``specfx demo --pair`` (``args`` from ``specfx demo``'s parser, the pair's defaults filled
    in): prints the completions, the speed table, τ, α and the identical-output check; writes the
    plot. Exit status 1 if specfx's greedy output differs from HF's."""
    import specfx
    from specfx.bench.harness import spinner, time_method, torch_threads
    from specfx.bench.plot import acceptance_plot
    from specfx.demo.pair import DEMO_PAIR_DIR, demo_drafter, demo_prompts, load_demo_pair

    device = torch.device(args.device)
    # small forwards are often faster on one thread (README, "Performance notes")
    with torch_threads(args.threads if device.type == "cpu" else None) as threads:
        with spinner("loading the demo pair"):
            target, draft, tok = load_demo_pair(device)
        n_t = sum(p.numel() for p in target.parameters()) / 1e6
        if args.draft == "draft":
            n_d = sum(p.numel() for p in draft.parameters()) / 1e6
            what = f"draft {n_d:.2f} M params"
        else:
            n_d = head_params(DEMO_PAIR_DIR / "heads" / args.draft) / 1e6
            what = f"{args.draft} head {n_d:.2f} M params"
        print(
            f"specfx demo: target {n_t:.1f} M params, {what} (trained on the Python stdlib), "
            f"K = {args.k}, {'sampling' if args.sample else 'greedy'}, {device}, {target.dtype} "
            f"(shipped as float16), {threads} torch thread(s)"
        )
        texts = args.prompt or [p["text"] for p in demo_prompts()[: args.num_prompts]]
        prompts = [tok(t, return_tensors="pt").input_ids.to(device) for t in texts]
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=tok.pad_token_id)
        if args.sample:
            kw.update(temperature=args.temperature, top_p=0.95)

        def seeded(fn):
            def run(ids):
                torch.manual_seed(args.seed)
                return fn(ids)

            return run

        def drafter():  # a head binds to one generator: a fresh one per speculate()
            return demo_drafter(args.draft, draft)

        try:
            eager = specfx.speculate(target, draft=drafter(), num_speculative_tokens=args.k, compile=False)
        except (ValueError, FileNotFoundError) as e:  # a missing head, or K deeper than Medusa's heads
            raise SystemExit(f"specfx demo: error: {e}") from None
        methods = {"HF generate()": seeded(lambda ids: target.generate(ids, **kw))}
        if args.draft == "draft":  # HF's assisted generation takes a draft model, not these heads
            methods[f"HF assisted (K={args.k})"] = seeded(lambda ids: assisted(target, draft, args.k, ids, kw))
        methods["specfx eager"] = seeded(lambda ids: eager.generate(ids, **kw))
        spec = eager
        if not args.no_compile:
            spec = specfx.speculate(target, draft=drafter(), num_speculative_tokens=args.k, compile=True)
            with spinner("compiling the prefill and round graphs (first call; ~1 min on a small CPU)"):
                spec.generate(prompts[0], **kw)
            methods["specfx compiled"] = seeded(lambda ids: spec.generate(ids, **kw))

        rows, outputs = {}, {}
        for name, fn in methods.items():
            with spinner(f"timing {name}"):
                t, outs = time_method(fn, prompts, args.repeats)
            rows[name] = sum(o.shape[1] - p.shape[1] for o, p in zip(outs, prompts, strict=True)) / t
            outputs[name] = outs
        spec.cumulative_stats = type(spec.stats)()  # the stats below: one marked pass over the prompts

        color = sys.stdout.isatty() and not args.no_color
        mark = f"{ACCEPTED_ON}green{ACCEPTED_OFF}" if color else f"{PLAIN_ON}between these marks{PLAIN_OFF}"
        print(f"\ncompletions (drafted-and-accepted tokens in {mark}):")
        for i, ids in enumerate(prompts):
            streamer = MarkingStreamer()
            torch.manual_seed(args.seed)
            spec.generate(ids, streamer=streamer, **kw)
            print(f"\n--- prompt {i + 1} ---\n{texts[i]}", end="")
            print("" if texts[i].endswith("\n") else "\n", end="")
            print("--- completion ---")
            print(render_marked(tok, streamer.tokens, color))

    base = rows["HF generate()"]
    print(f"\n{'method':<22}{'tokens/s':>10}{'vs HF generate()':>18}")
    for name, tps in rows.items():
        print(f"{name:<22}{tps:>10.1f}{tps / base:>17.2f}x")
    st = spec.cumulative_stats
    print(
        f"\nτ (tokens per round) = {st.tokens_per_round:.2f}, α (acceptance rate) = {st.acceptance_rate:.2f}, K = {args.k}"
    )
    print("acceptance by position: " + ", ".join(f"{r:.2f}" for r in st.per_position_rate))
    ref = outputs["HF generate()"]
    same = all(
        all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
        for name, outs in outputs.items()
        if name.startswith("specfx")
    )
    if args.sample:
        print(
            "sampling: outputs differ from HF's draw by design; the distribution is the target's (tests/lossless/test_lossless.py)"
        )
    else:
        print(f"greedy output identical to HF generate(): {'yes' if same else 'NO'}")
    png = acceptance_plot(
        args.plot,
        {f"specfx K = {args.k}": st.per_position_rate},
        rows,
        f"Speed ({args.max_new_tokens} new tokens, {device})",
    )
    if png is not None:
        print(f"plot: {png.resolve()}")
    return 0 if same or args.sample else 1
