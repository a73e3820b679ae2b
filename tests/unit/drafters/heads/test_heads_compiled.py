"""Every head type, compiled, on the six target families of issue 11, as a chain of 3 and as a
tree: one round graph, greedy output equal to model.generate(), and no recompile for new batch
contents.

CI traces the rounds with the ``specfx_eager`` backend (Dynamo's capture and specfx's passes,
run without Inductor: a few seconds per graph); each head's own test file compiles llama with
Inductor. For the full Inductor matrix run

    SPECFX_HEADS_BACKEND=specfx python -m pytest -q tests/unit/drafters/heads/test_heads_compiled.py

Heads are seeded random ones built in memory (their layouts and proposals are checked by
tests/unit/drafters/heads/test_medusa.py, test_eagle.py and test_eagle3.py); each runs, besides the chain,
the tree shape that exercises the most of it: Medusa a static tree, EAGLE an EAGLE-2 dynamic tree, EAGLE-3 a static
tree with a draft vocabulary smaller than the target's.
"""

import os

import pytest
import torch

import specfx
from specfx.testing.tiny import tiny_causal_lm
from specfx.trees.types import TokenTree
from tests.conftest import left_padded, tiered

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "mixtral")
BACKEND = os.environ.get("SPECFX_HEADS_BACKEND", "specfx_eager")
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def _head(kind: str, target):
    if kind == "medusa":
        config = target.config.get_text_config()
        return specfx.Medusa.random(config.hidden_size, target.get_output_embeddings().weight.shape[0], num_heads=3)
    if kind == "eagle":
        return specfx.Eagle.random(target, seed=1)
    return specfx.Eagle3.random(target, draft_vocab_size=96, seed=1, layer_ids=[1, 2, 3])  # 4 layers: 2, L//2, L-3 repeat


TREES = {"medusa": TREE, "eagle": TokenTree.eagle2(budget=8, depth=3, branching=3), "eagle3": TREE}


# CI: every kind's tree and chain on llama; gemma2's trees: pytest --full (the chain on every family
# takes as long again; SPECFX_HEADS_BACKEND=specfx runs all of it under Inductor)
CASES = [("tree", arch) for arch in ARCHS] + [("chain", arch) for arch in (ARCHS if BACKEND != "specfx_eager" else ("llama",))]


@pytest.mark.parametrize(
    ("shape", "arch"), tiered(CASES, [("tree", "llama")], several=True, ci=[("chain", "llama")])  # gemma2's trees: --full
)
@pytest.mark.parametrize("kind", tiered(sorted(TREES), ["eagle3"]))
def test_compiled_round(shape, kind, arch, one_thread):
    target = tiny_causal_lm(arch, num_layers=4)
    tree = TREES[kind]  # pinned: num_speculative_tokens = its node count
    round_shape = dict(num_speculative_tokens=3) if shape == "chain" else dict(tree=tree, num_speculative_tokens=tree.size)
    spec = specfx.speculate(target, draft=_head(kind, target), backend=BACKEND, background_compile=False, **round_shape)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    for length, pads in [(10, (0, 3)), (7, (2, 0))]:  # the second call: new contents, same shapes
        ids, mask = left_padded(length, pads, seed=length)
        want = target.generate(ids, attention_mask=mask, **kwargs)
        assert torch.equal(spec.generate(ids, attention_mask=mask, **kwargs), want)
    assert [e.key[0] for e in spec.compile_events] == ["round"], spec.compile_events  # one graph, compiled once
