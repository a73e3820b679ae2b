"""What ``specfx bench`` (:mod:`specfx.bench.tasks.default`) runs: the models and prompts it
loads, and the table of methods (HF's peers and specfx's generators at every K) for one batch
size, each a function of a batch ``{"input_ids": [B, S], "attention_mask": [B, S]}``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specfx.bench.harness import (
    NO_EOS,
    hf_assisted,
    hf_compile_config,
)
from specfx.model.load import check_model_dir, load_causal_lm, load_tokenizer

__all__ = ["NAMED_DRAFTERS", "build_methods", "drafter_tree", "load_models", "make_batches"]

NAMED_DRAFTERS = ("prompt_lookup", "early_exit", "mtp")


def load_models(args, device, dtype):
    """(target, draft model or drafter name, tokenizer or None, description). Paths are local
    model directories with safetensors weights (:mod:`specfx.model.load`); a bad one raises
    ValueError before anything is loaded."""
    from specfx.demo.pair import load_demo_pair

    draft = args.draft
    load_draft = draft is not None and draft.partition(":")[0] not in NAMED_DRAFTERS
    if load_draft:
        check_model_dir(draft)  # a bad path fails now, not after the target's load
    if args.target is None:
        target, draft_model, tok = load_demo_pair(device, dtype)
        desc = "shipped demo pair (specfx/demo/demo_pair)"
    else:
        target, draft_model = load_causal_lm(args.target, dtype, device), None
        tok, desc = load_tokenizer(args.target), f"target {args.target}"
    if draft is None:
        draft = draft_model if draft_model is not None else "prompt_lookup"
    elif load_draft:
        draft = load_causal_lm(draft, dtype, device)
    return target, draft, tok, desc + (f", draft {args.draft}" if args.draft else "")


def make_batches(tok, vocab: int, batch: int, num_prompts: int, device) -> list[dict]:
    """Left-padded batches of held-out code prompts (random ids when there is no tokenizer)."""
    from specfx.demo.pair import demo_prompts

    texts = [p["text"] for p in demo_prompts()]
    n_batches = max(1, math.ceil(num_prompts / batch))
    batches = []
    for j in range(n_batches):
        rows = [texts[(j * batch + r) % len(texts)] for r in range(batch)]
        if tok is not None:
            enc = tok(rows, return_tensors="pt", padding=True, padding_side="left")
        else:
            g = torch.Generator().manual_seed(j)
            ids = torch.randint(3, vocab, (batch, 48), generator=g)
            enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        batches.append({k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")})
    return batches


def build_methods(args, target, draft, batch: int, device) -> tuple[dict, dict]:
    import specfx

    n = args.max_new_tokens
    greedy = dict(max_new_tokens=n, do_sample=False, pad_token_id=target.generation_config.pad_token_id, **NO_EOS)
    methods: dict[str, Callable] = {
        "hf_dynamic": lambda b: target.generate(**b, **greedy),
        "hf_static": lambda b: target.generate(**b, cache_implementation="static", **greedy),
    }
    if not args.no_compile:
        cc = hf_compile_config(device)
        methods["hf_static_compiled"] = lambda b: target.generate(
            **b, cache_implementation="static", compile_config=cc, **greedy
        )
    specs = {}
    for k in args.k_values:
        if batch == 1:
            methods[f"hf_assisted@{k}"] = lambda b, k=k: assisted_generate(target, draft, k, b, greedy)
            for d in args.drafter_names:  # HF's counterpart of a named drafter (prompt lookup), where HF has one
                if d.partition(":")[0] in NAMED_DRAFTERS:
                    methods[f"hf_assisted[{d}]@{k}"] = lambda b, k=k, d=d: assisted_generate(target, d, k, b, greedy)
        if args.drafter_names:
            continue
        for compiled in (False, True) if not args.no_compile else (False,):
            name = f"specfx_{'compiled' if compiled else 'eager'}@{k}"
            spec = specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=compiled)
            methods[name] = lambda b, spec=spec: spec.generate(**b, **greedy)
            specs[name] = spec
    if args.auto and not args.drafter_names:
        for compiled in (False, True) if not args.no_compile else (False,):
            name = f"specfx_{'compiled' if compiled else 'eager'}@auto"
            specs[name] = spec = specfx.speculate(target, draft=draft, num_speculative_tokens="auto", compile=compiled)
            methods[name] = lambda b, spec=spec: spec.generate(**b, **greedy)
    if args.drafter_names:
        from specfx.demo.pair import DEMO_DRAFTERS, demo_drafter
    for d in args.drafter_names:  # the drafters side by side (module docstring)
        runs = [(str(k), dict(num_speculative_tokens=k)) for k in args.k_values]
        if args.auto:
            runs.append(("auto", dict(num_speculative_tokens="auto")))
        if args.tree_budget:
            tree = drafter_tree(d, args.tree_budget)  # pinned: the tree every round, not "auto"'s choice
            runs.append((f"tree{args.tree_budget}", dict(tree=tree, num_speculative_tokens=tree.size)))
        for label, how in runs:
            for compiled in (False, True) if not args.no_compile else (False,):
                name = f"specfx_{'compiled' if compiled else 'eager'}[{d}]@{label}"
                try:  # a shipped name, else the name passed to speculate() (a fresh drafter per generator)
                    drafter = demo_drafter(d, draft) if d in DEMO_DRAFTERS else d
                    spec = specfx.speculate(target, draft=drafter, compile=compiled, **how)
                except ValueError as e:  # e.g. K deeper than Medusa's heads: listed as not run
                    methods[name] = lambda b, e=e: _raise(e)
                    continue
                methods[name] = lambda b, spec=spec: spec.generate(**b, **greedy)
                specs[name] = spec
    skip = {m for m in methods if {m, m.split("@")[0], m.split("@")[0].partition("[")[0]} & args.skip_set}
    return {m: f for m, f in methods.items() if m not in skip}, {m: s for m, s in specs.items() if m not in skip}


def drafter_tree(name: str, budget: int):
    """The one tree per drafter of ``--tree-budget`` (module docstring)."""
    from specfx.trees.types import TokenTree

    name = name.partition(":")[0]  # eagle3:DIR is an EAGLE-3 head too
    if name in ("eagle3", "eagle"):
        return TokenTree.eagle2(budget=budget)
    if name == "medusa":
        return TokenTree.medusa(budget=budget)
    return TokenTree.topk(depth=max(1, budget // 2), branching=2, budget=budget)


def _raise(e: Exception):
    raise e


def assisted_generate(target, draft, k: int, batch: dict, kwargs: dict) -> torch.Tensor:
    """HF assisted generation with K constant proposals (settings restored after the call)."""
    with hf_assisted(target, draft, k) as assisted:
        return target.generate(**batch, **assisted, **kwargs)
