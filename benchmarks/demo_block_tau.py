"""Greedy τ of drafters on the demo pair's 12 held-out prompts (issue 28, sessions 32 and 34).

    PYTHONPATH=. python benchmarks/demo_block_tau.py pard:DIR dflash:DIR draft eagle3
    PYTHONPATH=. python benchmarks/demo_block_tau.py --shapes 4,medusa-16,topk-4-2-16,eagle2 pard:DIR eagle3

64 new tokens a prompt, K = 4, 8, 16 (``--shapes``: chains ``K``, static trees ``medusa-N``, ``eagle-N``, ``topk-D-B-N``
(depth, branching, nodes) and EAGLE-2's dynamic ``eagle2``), eager rounds, one thread: greedy rounds accept the same tokens
compiled or not, so τ (tokens per round, every call of the generator counted) is exact; every output
is checked equal to the target's ``generate()``. ``draft``: the shipped demo draft; ``eagle3``: the
shipped head; ``pard:DIR`` / ``dflash:DIR``: a block draft. Prints one line per drafter and K,
with the acceptance rate of each proposal position.
"""

import sys

import torch
from transformers import AutoModelForCausalLM

import specfx
from specfx.demo.pair import DEMO_PAIR_DIR, demo_prompts, load_demo_pair


def drafter(name: str, draft):
    if name.startswith("pard:"):
        return specfx.Pard(AutoModelForCausalLM.from_pretrained(name[5:], dtype=torch.float32).eval())
    if name.startswith("dflash:"):
        return name
    if name == "eagle3":
        return f"eagle3:{DEMO_PAIR_DIR / 'heads' / 'eagle3'}"
    if name == "draft":
        return draft
    raise SystemExit(f"unknown drafter {name!r}: pard:DIR, dflash:DIR, draft or eagle3")


def round_shape(name: str) -> dict:
    """``speculate()``'s round arguments for a ``--shapes`` item (every round that shape: no "auto")."""
    if name.isdigit():
        return dict(num_speculative_tokens=int(name))
    kind, *args = name.split("-")
    T = specfx.TokenTree
    trees = {"medusa": T.medusa, "eagle": T.eagle, "topk": T.topk, "eagle2": T.eagle2}
    if kind not in trees:
        raise SystemExit(f"unknown shape {name!r}: K, medusa-N, eagle-N, topk-D-B-N or eagle2[-N-D-B]")
    tree = trees[kind](*map(int, args))
    return dict(tree=tree, num_speculative_tokens=tree.size)


def main(names: list[str], shapes: list[str]) -> None:
    torch.set_num_threads(1)
    target, draft, tok = load_demo_pair()
    prompts = [tok(p["text"], return_tensors="pt").input_ids for p in demo_prompts()]
    kw = dict(max_new_tokens=64, do_sample=False)
    refs = [target.generate(p, attention_mask=torch.ones_like(p), **kw) for p in prompts]
    for name in names:
        for k in shapes:
            try:
                spec = specfx.speculate(target, draft=drafter(name, draft), compile=False, **round_shape(k))
            except ValueError as e:  # a shape the drafter cannot draft (a dynamic tree but for EAGLE heads)
                print(f"{name} K={k}: refused ({str(e)[:80]}...)", flush=True)
                continue
            for p, ref in zip(prompts, refs, strict=True):
                assert torch.equal(spec.generate(p, attention_mask=torch.ones_like(p), **kw), ref), name
            st = spec.cumulative_stats
            rates = [round(x, 2) for x in st.per_position_rate]
            print(f"{name} K={k}: tau {st.tokens_per_round:.3f} per_position {rates}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    shapes = ["4", "8", "16"]
    if args[:1] == ["--shapes"]:
        shapes, args = args[1].split(","), args[2:]
    main(args, shapes)
