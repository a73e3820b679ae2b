"""Token trees (specfx.trees.types, specfx.engine.tree_round): validation and builders, the device tables
checked against a brute-force walk, the acceptance walk by scenario, its sampling law checked
exactly, KV compaction against a fresh prefill, greedy equality with ``model.generate()`` for
several tree shapes, and the compiled tree round (one graph, no recompiles).

The architecture matrix with a tree lives in tests/conformance/test_conformance.py, the chi-square
tests of sampling with trees in tests/lossless/test_lossless.py, tree masks in tests/unit/model/test_masks.py.
"""

import random

import pytest
import torch
from scipy import stats

import specfx
from specfx.drafters.draft_model import DraftModel
from specfx.engine import tree_round
from specfx.model.hf_names import output_cache
from specfx.model.runner import ModelRunner
from specfx.passes.checks.no_host_sync import offending_nodes
from specfx.sampling import accept
from specfx.trees.types import MAX_TREE_NODES, TokenTree, TreeTensors
from tests.conftest import left_padded, pair, prompt

# nodes 1..6 = (0,) (1,) (0,0) (0,1) (1,0) (0,0,0): two children at the root and under (0,),
# one under (1,), a third level under (0,0)
SIX = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
SIX_PARENTS = (0, 0, 0, 1, 1, 2, 3)


# --------------------------------------------------------------------------- brute force
def reference_tables(parent: list[int], max_depth: int):
    """``(depth [N+1], ancestors [N+1][N+1], path [N+1][D+1])`` of one tree given as parent
    indices, by walking up from every node in plain Python (TreeTensors' definitions)."""
    n1 = len(parent)
    chains = []
    for n in range(n1):
        chain = [n]  # n, its parent, ..., the root
        while chain[-1] != 0:
            chain.append(parent[chain[-1]])
        chains.append(chain)
    depth = [len(c) - 1 for c in chains]
    ancestors = [[m in chains[n] for m in range(n1)] for n in range(n1)]
    path = [[chains[n][depth[n] - d] if d <= depth[n] else n for d in range(max_depth + 1)] for n in range(n1)]
    return depth, ancestors, path


def random_parents(n: int, rng: random.Random) -> list[int]:
    """A random tree of n nodes as parent indices (each parent precedes its child)."""
    return [0] + [rng.randrange(i) for i in range(1, n + 1)]


# --------------------------------------------------------------------------- TokenTree
@pytest.mark.parametrize(
    ("nodes", "error", "match"),
    [
        ([], ValueError, r"at least one node"),
        ([(0,), (0, 0, 0)], ValueError, r"\(0, 0, 0\) has no parent: \(0, 0\) is not in the tree"),
        ([(0,), (1, 0)], ValueError, r"\(1, 0\) has no parent: \(1,\) is not in the tree"),
        ([(0,), (0, 1), [0, 1]], ValueError, r"node \(0, 1\) appears twice"),
        ("(0,)", TypeError, r"tree must be a list of nodes .* got str"),
        (7, TypeError, r"tree must be a list of nodes .* got int"),
        ([(0,), 1], TypeError, r"tree node 1 must be a tuple of child ranks .* got 1"),
        ([(0,), "01"], TypeError, r"tree node 1 must be a tuple of child ranks"),
        ([()], ValueError, r"tree node 0 must be a non-empty tuple of ints >= 0"),
        ([(0,), (-1,)], ValueError, r"tree node 1 must be a non-empty tuple of ints >= 0 .* got \(-1,\)"),
        ([(0,), (0.5,)], ValueError, r"tree node 1 must be a non-empty tuple"),
        ([(True,)], ValueError, r"tree node 0 must be a non-empty tuple"),
        (
            [(0,) * d for d in range(1, MAX_TREE_NODES + 2)],
            ValueError,
            rf"{MAX_TREE_NODES + 1} nodes; at most {MAX_TREE_NODES}",
        ),
    ],
)
def test_invalid_trees_are_clear_errors(nodes, error, match):
    with pytest.raises(error, match=match):
        TokenTree(nodes)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: TokenTree.chain(0), r"a chain needs an int length >= 1, got 0"),
        (lambda: TokenTree.chain(2.0), r"a chain needs an int length >= 1"),
        (lambda: TokenTree.topk(depth=0, branching=2), r"depth must be an int >= 1, got 0"),
        (lambda: TokenTree.topk(depth=2, branching=True), r"branching must be an int >= 1, got True"),
        (lambda: TokenTree.topk(depth=5, branching=3), r"topk\(depth=5, branching=3\) has 363 nodes.*pass budget="),
        (lambda: TokenTree.topk(depth=3, branching=2, budget=0), r"budget must be an int >= 1, got 0"),
        (lambda: TokenTree.medusa(budget=MAX_TREE_NODES + 1), rf"budget must be at most {MAX_TREE_NODES}"),
        (lambda: TokenTree.from_accuracies(lambda d, r: 0.5, 8, max_depth=0, branching=2), r"max_depth must be"),
    ],
)
def test_invalid_builder_arguments_are_clear_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_nodes_are_sorted_and_indexed():
    tree = TokenTree([(1, 0), (0, 0, 0), (0,), (0, 1), [1], (0, 0)])  # any order, lists accepted
    assert tree == SIX and hash(tree) == hash(SIX)  # one graph key whatever the input order
    assert tree.nodes == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == SIX_PARENTS
    assert tree.depths == (0, 1, 1, 2, 2, 2, 3)
    assert tree.ranks == (0, 1, 0, 1, 0, 0)
    assert (tree.size, tree.depth) == (6, 3)
    assert [tree.level(d) for d in (1, 2, 3, 4)] == [(1, 2), (3, 4, 5), (6,), ()]
    assert [n for n in range(7) if tree.has_children(n)] == [0, 1, 2, 3]
    assert not tree.is_chain and TokenTree(tree) == tree
    assert repr(tree) == "TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])"


def test_chains():
    chain = TokenTree.chain(5)
    assert chain.nodes == tuple((0,) * d for d in range(1, 6)) and chain.is_chain
    assert (chain.size, chain.depth, repr(chain)) == (5, 5, "TokenTree.chain(5)")
    assert chain.parents == (0, 0, 1, 2, 3, 4)
    assert not TokenTree([(1,)]).is_chain  # the second guess alone is no chain


def _expected_score(tree_node, accuracies):
    score = 1.0
    for d, r in enumerate(tree_node, start=1):
        score *= accuracies(d, r)
    return score


# the acceptance models the builders document (depth d 1-based, rank r)
def topk_accuracy(d, r):
    return 0.6 * 0.4**r


def medusa_accuracy(d, r):
    return (0.75, 0.5, 0.38, 0.3)[d - 1] * 0.35**r


def eagle_accuracy(d, r):
    return 0.8 * 0.9 ** (d - 1) * 0.3**r


@pytest.mark.parametrize(
    ("tree", "size", "max_depth", "branching", "accuracies"),
    [
        (TokenTree.topk(depth=3, branching=2), 14, 3, 2, topk_accuracy),
        (TokenTree.topk(depth=4, branching=3), 120, 4, 3, topk_accuracy),
        (TokenTree.topk(depth=4, branching=3, budget=16), 16, 4, 3, topk_accuracy),
        (TokenTree.topk(depth=2, branching=4, budget=5), 5, 2, 4, topk_accuracy),
        (TokenTree.medusa(), 63, 4, 10, medusa_accuracy),
        (TokenTree.medusa(budget=24), 24, 4, 10, medusa_accuracy),
        (TokenTree.eagle(), 63, 5, 10, eagle_accuracy),
        (TokenTree.eagle(budget=10), 10, 5, 10, eagle_accuracy),
        (TokenTree.from_accuracies(lambda d, r: 0.9 / (1 + r) / d, 12, max_depth=3, branching=3), 12, 3, 3, None),
    ],
)
def test_builders_give_valid_trees_of_the_stated_size(tree, size, max_depth, branching, accuracies):
    assert tree.size == size
    assert TokenTree(tree.nodes) == tree  # valid: every parent present, no duplicates
    assert tree.depth <= max_depth and max(r for node in tree.nodes for r in node) < branching
    if accuracies is None:
        return
    # best-first: no node left out (within depth and branching) beats a node chosen
    chosen = {node: _expected_score(node, accuracies) for node in tree.nodes}
    frontier = [node + (r,) for node in ((),) + tree.nodes for r in range(branching) if len(node) < max_depth]
    left_out = [_expected_score(node, accuracies) for node in frontier if node not in chosen]
    if left_out:
        assert min(chosen.values()) >= max(left_out) - 1e-12
    full = sum(branching**d for d in range(1, max_depth + 1))
    assert (size == full) == (not left_out)


# --------------------------------------------------------------------------- TreeTensors
def _check_tables(tables: TreeTensors, parents: list[list[int]], max_depth: int):
    assert tables.max_depth == max_depth and tables.size == len(parents[0]) - 1
    for r, parent in enumerate(parents):
        depth, ancestors, path = reference_tables(parent, max_depth)
        assert tables.parent[r].tolist() == parent
        assert tables.depth[r].tolist() == depth
        assert tables.ancestors[r].tolist() == ancestors
        assert tables.path[r].tolist() == path


@pytest.mark.parametrize(
    "tree",
    [SIX, TokenTree.chain(4), TokenTree.topk(3, 2), TokenTree.medusa(24), TokenTree.eagle(), TokenTree([(2,), (2, 1)])],
    ids=["six", "chain4", "topk3x2", "medusa24", "eagle63", "sparse-ranks"],
)
def test_tree_tensors_match_a_brute_force_walk(tree):
    tables = tree.tensors("cpu")
    assert tables.parent.shape == (1, tree.size + 1) and tables.path.shape == (1, tree.size + 1, tree.depth + 1)
    _check_tables(tables, [list(tree.parents)], tree.depth)
    assert tuple(tables.depth[0].tolist()) == tree.depths


def test_tree_tensors_per_row():
    """A tree per row ([B, N+1] parents, same N, different shapes and depths), as a drafter
    could supply one; random parent arrays cover shapes no builder makes."""
    rng = random.Random(0)
    parents = [list(SIX_PARENTS), list(TokenTree.chain(6).parents)] + [random_parents(6, rng) for _ in range(6)]
    max_depth = max(max(reference_tables(p, 6)[0]) for p in parents)
    tables = TreeTensors.from_parents(torch.tensor(parents), max_depth)
    assert tables.ancestors.shape == (8, 7, 7)
    _check_tables(tables, parents, max_depth)


# --------------------------------------------------------------------------- tree_accept
V = 20
# the pending token, then the tokens of nodes 1..6 of SIX
SIX_TOKENS = [9, 10, 11, 12, 13, 14, 15]


def _greedy_walk(argmax: dict[int, int], tokens=SIX_TOKENS, tree=SIX):
    """tree_accept on one greedy row: the target's argmax at each node (0 at nodes not given)."""
    scores = torch.zeros(1, tree.size + 1, V)  # [1, N+1, V]
    for node in range(tree.size + 1):
        scores[0, node, argmax.get(node, 0)] = 1.0
    stop, last, probs = accept.tree_accept(scores, torch.tensor([tokens]), tree.tensors("cpu"), sample=False)
    assert probs is None
    return int(stop), int(last)


# scenario -> (the target's argmax per node, the node the walk stops at, the token after it)
GREEDY_SCENARIOS = {
    "perfect match down the deepest branch": ({0: 10, 1: 12, 3: 15, 6: 7}, 6, 7),
    "mismatch at the root": ({0: 3, 1: 12, 2: 14}, 0, 3),
    "match on the root's second child": ({0: 11, 2: 14, 5: 4}, 5, 4),
    "match on a second child at depth 2": ({0: 10, 1: 13, 4: 8}, 4, 8),
    "first child accepted, its child rejected": ({0: 10, 1: 2, 3: 15}, 1, 2),
    "a matching token under another parent is not taken": ({0: 10, 1: 14}, 1, 14),  # 14 is node 5's, under node 2
}


@pytest.mark.parametrize("scenario", sorted(GREEDY_SCENARIOS))
def test_greedy_walk(scenario):
    argmax, stop, last = GREEDY_SCENARIOS[scenario]
    assert _greedy_walk(argmax) == (stop, last)


def test_greedy_duplicate_tokens_among_siblings_take_the_first():
    """Nodes 1 and 2 both propose 10: the walk goes to node 1 (rank order) and continues there;
    node 2's subtree is never reached even when its child matches."""
    tokens = [9, 10, 10, 12, 13, 14, 15]
    assert _greedy_walk({0: 10, 1: 12, 3: 15, 6: 5}, tokens) == (6, 5)
    assert _greedy_walk({0: 10, 1: 14, 2: 14}, tokens) == (1, 14)


def test_greedy_rows_walk_independently():
    """Every scenario at once as the rows of one batch (one tree for all rows), then with a tree
    per row ([B, N+1] tables): each row's result is its own scenario's."""
    cases = list(GREEDY_SCENARIOS.values())
    b = len(cases)
    scores = torch.zeros(b, SIX.size + 1, V)
    for row, (argmax, _, _) in enumerate(cases):
        for node in range(SIX.size + 1):
            scores[row, node, argmax.get(node, 0)] = 1.0
    tokens = torch.tensor([SIX_TOKENS] * b)
    stop, last, _ = accept.tree_accept(scores, tokens, SIX.tensors("cpu"), sample=False)
    assert list(zip(stop.tolist(), last.tolist(), strict=True)) == [(s, t) for _, s, t in cases]

    # row 1 is a chain of 6 instead: its argmax 10 -> 11 -> 12 follows the chain's first three nodes
    parents = torch.tensor([SIX_PARENTS, TokenTree.chain(6).parents])
    tables = TreeTensors.from_parents(parents, 6)
    two = torch.zeros(2, 7, V)
    for node, tok in {0: 10, 1: 12, 3: 15, 6: 7}.items():
        two[0, node, tok] = 1.0
    for node, tok in {0: 10, 1: 11, 2: 12, 3: 5}.items():
        two[1, node, tok] = 1.0
    stop, last, _ = accept.tree_accept(two, tokens[:2], tables, sample=False)
    assert stop.tolist() == [6, 3] and last.tolist() == [7, 5]


def _sampling_scores(p_root: dict[int, float], b: int = 1) -> torch.Tensor:
    """Scores [B, N+1, V] of SIX whose root distribution is ``p_root`` (the rest spread evenly
    over the other tokens) and whose nodes are uniform."""
    rest = (1 - sum(p_root.values())) / (V - len(p_root))
    root = torch.full((V,), rest)
    for tok, p in p_root.items():
        root[tok] = p
    scores = torch.zeros(b, SIX.size + 1, V)
    scores[:, 0] = root.log()
    return scores


def _sample_walk(scores, tokens, u_first_children, u_residual=None):
    b = scores.shape[0]
    u_accept = torch.full((b, SIX.size), 0.5)
    u_accept[:, :2] = torch.tensor(u_first_children)
    u_residual = torch.rand(b, V) if u_residual is None else u_residual
    return accept.tree_accept(scores, tokens, SIX.tensors("cpu"), True, u_accept, u_residual)


def test_sampling_renormalises_after_a_rejection():
    """Child 1 (p = 0.5) is rejected by u = 0.6; child 2 (p = 0.3) is then accepted with
    probability 0.3 / (1 - 0.5) = 0.6: u = 0.55 accepts it (without renormalising it would
    not), u = 0.65 rejects it."""
    scores = _sampling_scores({10: 0.5, 11: 0.3})
    tokens = torch.tensor([SIX_TOKENS])
    assert int(_sample_walk(scores, tokens, [0.4, 0.99])[0]) == 1  # u < p(child 1): accepted (then its
    assert int(_sample_walk(scores, tokens, [0.6, 0.55])[0]) == 2  # children, p = 1/20, rejected by u = 0.5)
    stop, last, _ = _sample_walk(scores.expand(2000, -1, -1), tokens.expand(2000, -1), [0.6, 0.65])
    assert (stop == 0).all() and not torch.isin(last, torch.tensor([10, 11])).any()  # residual excludes both


def test_sampling_duplicate_sibling_is_rejected_on_its_second_try():
    """Nodes 1 and 2 both propose 10 (p = 0.5): once node 1 is rejected, node 2 is rejected
    whatever its uniform, and the residual never emits 10."""
    b = 4000
    scores = _sampling_scores({10: 0.5}, b)
    tokens = torch.tensor([[9, 10, 10, 12, 13, 14, 15]] * b)
    stop, last, _ = _sample_walk(scores, tokens, [0.9, 1e-6])
    assert (stop == 0).all()
    assert (last != 10).all()
    assert last.unique().numel() > V // 2  # the residual really is sampled


# An exact check of the sampling walk's law on a tree with every hazard: duplicate siblings
# (nodes 1, 2 -> token 2), the same token under two parents (nodes 4 and 7 -> token 1), nodes
# under an unreachable duplicate (node 6), depth 3.
LAW_TREE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0)])
LAW_TOKENS = [0, 2, 2, 4, 1, 1, 3, 1, 3]  # the pending token, then nodes 1..8
LAW_V = 5


def _exact_round_law(p: torch.Tensor, parents, tokens) -> dict[tuple, float]:
    """P(the round emits exactly this token sequence) when the target's distribution at node n
    is ``p[n]`` (no speculation): draw a token at the current node; if a child (the first in
    rank order) proposed it, continue there, else stop."""
    law: dict[tuple, float] = {}

    def walk(node, prefix, prob):
        for x in range(LAW_V):
            kids = [c for c in range(1, len(parents)) if parents[c] == node and tokens[c] == x]
            if kids:
                walk(kids[0], prefix + (x,), prob * float(p[node, x]))
            else:
                law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + prob * float(p[node, x])

    walk(0, (), 1.0)
    return law


def test_sampling_walk_emits_each_sequence_with_its_target_probability():
    """Multi-candidate acceptance is lossless: over 200k random draws, the sequences one round
    emits (accepted path, then the residual token) follow the law of sampling the target token
    by token (chi-square, p > 1e-3); the draws accept at every depth."""
    gen = torch.Generator().manual_seed(0)
    n1, b = LAW_TREE.size + 1, 200_000
    logits = torch.randn(n1, LAW_V, generator=gen, dtype=torch.float64) * 0.5  # [N+1, V]
    for child, parent in enumerate(LAW_TREE.parents[1:], start=1):  # proposals likely enough to
        logits[parent, LAW_TOKENS[child]] += 1.0  # be accepted often at every depth
    tables = LAW_TREE.tensors("cpu")
    tokens = torch.tensor([LAW_TOKENS]).expand(b, -1)
    u_accept = torch.rand(b, n1 - 1, generator=gen, dtype=torch.float64)
    u_residual = torch.rand(b, LAW_V, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    stop, last, _ = accept.tree_accept(logits.expand(b, -1, -1), tokens, tables, True, u_accept, u_residual)
    depth = tables.depth[0, stop]
    path = tables.path[0, stop]  # [B, D+1]
    counts: dict[tuple, int] = {}
    for row_path, d, x in zip(tokens.gather(1, path).tolist(), depth.tolist(), last.tolist(), strict=True):
        seq = tuple(row_path[1 : d + 1]) + (x,)
        counts[seq] = counts.get(seq, 0) + 1
    law = _exact_round_law(logits.softmax(-1), LAW_TREE.parents, LAW_TOKENS)
    assert set(counts) <= set(law)
    assert abs(sum(law.values()) - 1) < 1e-9
    assert torch.bincount(depth, minlength=4)[1:].min() > 1000  # accepted at depths 1, 2 and 3
    seqs = sorted(law)
    observed = [counts.get(s, 0) for s in seqs]
    assert stats.chisquare(observed, [law[s] * b for s in seqs]).pvalue > 1e-3


# --------------------------------------------------------------------------- KV compaction
class SecondBestDraft(DraftModel):
    """A draft model whose two best tokens trade places: its rank-1 child at every node is what
    the model itself ranks first, so with a draft close to the target the accepted paths run
    through second children (and move from scratch slots L + n to L + depth)."""

    def __init__(self, model):
        super().__init__(model)
        self.runner = _SwappedTopTwo(self.runner)


class _SwappedTopTwo:
    """A ModelRunner whose forward returns logits with the two best tokens' scores swapped;
    everything else (its cache, its probes, tree_refusal) is the real runner's."""

    def __init__(self, runner):
        self._runner = runner

    def forward(self, *args, **kwargs):
        logits = self._runner.forward(*args, **kwargs)  # [B, T, V]
        top = logits.topk(2, dim=-1)
        return logits.scatter(-1, top.indices.flip(-1), top.values)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def _fresh_kv(model, tokens: torch.Tensor):
    """Every layer's (keys, values) ``[B, H, T, D]`` after a fresh prefill of ``tokens [B, T]``
    at positions 0..T-1 through a new ModelRunner and SlotCache."""
    runner = ModelRunner(model, role="reference")
    b, t = tokens.shape
    runner.allocate(b, t + 2)
    positions = torch.arange(t).expand(b, t)
    with torch.no_grad():
        runner.forward(tokens, positions, positions)
    return [(layer.keys[:, :, :t], layer.values[:, :, :t]) for layer in runner.cache.layers]


def _assert_cache_matches(cache, fresh, lengths):
    for layer, (keys, values) in zip(cache.layers, fresh, strict=True):
        for row, n in enumerate(lengths):
            torch.testing.assert_close(layer.keys[row, :, :n], keys[row, :, :n], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(layer.values[row, :, :n], values[row, :, :n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "padded"),
    [("llama", False), ("llama", True), ("gemma2", True)],
    ids=["llama-b1", "llama-padded", "gemma2-padded"],
)
def test_committed_kv_equals_a_fresh_prefill(arch, padded, monkeypatch, one_thread):
    """After tree rounds whose accepted paths ran through second children, the target's KV at
    every committed slot 0..L-1 and the draft's at 0..L-2 (its invariant: the catch-up rewrites
    L-1) equal a fresh prefill of the emitted tokens; greedy output equals generate()."""
    target, perturbed = pair(arch, "perturbed")
    stops = []

    def recording(*args, **kwargs):
        result = real_accept(*args, **kwargs)
        stops.append(result[0].clone())
        return result

    real_accept = tree_round.tree_accept
    monkeypatch.setattr(tree_round, "tree_accept", recording)
    tree = TokenTree.topk(depth=3, branching=2)  # node (1, 1, 1) is node 14, slot L + 14 -> L + 3
    spec = specfx.speculate(target, draft=SecondBestDraft(perturbed), tree=tree, num_speculative_tokens=tree.size, compile=False)
    ids, mask = left_padded(11, [4, 0, 2], seed=2) if padded else (prompt(11, seed=2), None)
    kw = dict(max_new_tokens=24, do_sample=False, attention_mask=mask)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))

    rows = ids.shape[0]
    accepted = [tree.nodes[s - 1] for step in stops for s in step[:rows].tolist() if s > 0]
    assert sum(1 for node in accepted if len(node) >= 2 and 1 in node) >= 3, accepted
    lengths = spec.state.lengths[:rows].tolist()
    tokens = spec.state.tokens[:rows, : max(lengths)]  # slot == position: the emitted sequences
    _assert_cache_matches(spec.target_runner.cache, _fresh_kv(target, tokens), lengths)
    _assert_cache_matches(spec.drafter.runner.cache, _fresh_kv(perturbed, tokens), [n - 1 for n in lengths])


def test_return_dict_with_a_tree_matches_hf(one_thread):
    """With paths through second children and a repetition penalty: HF's per-step scores and
    logits (those of the accepted path's nodes), and the returned cache (built from the compacted
    KV) that continue like HF's; batch 3, so the buffers hold an inert fourth row."""
    from tests.api.test_outputs import _assert_same_continuation

    target, perturbed = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=SecondBestDraft(perturbed), tree=TokenTree.topk(3, 2), compile=False)
    ids, mask = left_padded(9, [0, 4, 2], seed=11)
    kw = dict(attention_mask=mask, max_new_tokens=14, repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    kw.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    ours, hf = spec.generate(ids, **kw), target.generate(ids, **kw)
    assert torch.equal(ours.sequences, hf.sequences)
    assert len(ours.scores) == len(hf.scores) == len(ours.logits) == 14
    for a, b in zip(ours.scores + ours.logits, hf.scores + hf.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    full_mask = torch.cat([mask, torch.ones_like(hf.sequences[:, ids.shape[1] :])], dim=1)
    _assert_same_continuation(target, output_cache(ours), output_cache(hf), ours.sequences, full_mask)


# --------------------------------------------------------------------------- greedy equality
TREES = {
    "3": TokenTree([(0,), (1,), (0, 0)]),
    "7": TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]),
    "16": TokenTree.topk(depth=4, branching=3, budget=16),
    "medusa24": TokenTree.medusa(budget=24),
    "chain20": TokenTree.chain(20),  # a chain longer than any chain round: runs as a tree round
}


@pytest.mark.parametrize("shape", list(TREES))
def test_greedy_equals_generate(shape, one_thread):
    """Batch 1 and a left-padded batch (llama); batch 1 with learned positions (gpt2)."""
    tree = TREES[shape]
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, tree=tree, num_speculative_tokens=tree.size, compile=False)
    assert spec.tree == tree
    ids = prompt(12, seed=3)
    kw = dict(max_new_tokens=30, do_sample=False)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert spec.stats.per_depth[1] > 0  # acceptance past depth 1 happened
    ids, mask = left_padded(10, [3, 0, 5], seed=4)
    kw["attention_mask"] = mask
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert len(spec.stats.per_row_accepted) == 3 and min(spec.stats.per_row_accepted) > 0
    gpt2, gpt2_draft = pair("gpt2", "perturbed")
    spec = specfx.speculate(gpt2, draft=gpt2_draft, tree=tree, num_speculative_tokens=tree.size, compile=False)
    ids = prompt(9, seed=6)
    assert torch.equal(spec.generate(ids, max_new_tokens=20), gpt2.generate(ids, max_new_tokens=20))


def test_eos_min_new_tokens_and_penalty_with_a_tree(one_thread):
    """Rows stop at an EOS inside an accepted path (batch rows finishing at different rounds),
    min_new_tokens suppresses it at the right depth, and the repetition penalty counts the
    tokens on each node's path: all as generate() does."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, tree=TREES["7"], num_speculative_tokens=7, compile=False)
    ids, mask = left_padded(10, [3, 0, 5], seed=4)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    eos = [int(plain[0, 15]), int(plain[1, 13])]
    for extra in (
        dict(eos_token_id=eos[0]),
        dict(eos_token_id=eos),
        dict(eos_token_id=eos[0], min_new_tokens=12, repetition_penalty=1.5),
        dict(repetition_penalty=1.3),
    ):
        kw = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, **extra)
        expected = target.generate(ids, **kw)
        assert torch.equal(spec.generate(ids, **kw), expected), extra
    assert spec.cumulative_stats.per_depth[2] > 0


def test_a_short_chain_runs_as_the_chain_round():
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, tree=TokenTree.chain(4), compile=False)
    assert spec.tree is None and spec.k == 4
    assert specfx.speculate(target, draft=draft, tree=TREES["chain20"], compile=False).tree == TREES["chain20"]


def test_drafters_that_cannot_branch_are_refused():
    target, _ = pair("llama", "perturbed")

    class ChainOnly(specfx.drafters.base.Drafter):
        name = "chain_only"

    with pytest.raises(ValueError, match=r"speculate\(tree=...\): the chain_only drafter drafts a chain only"):
        specfx.speculate(target, draft=ChainOnly(), tree=SIX, compile=False)
    with pytest.raises(ValueError, match=r"tree of 6 nodes, and with a tree num_speculative_tokens is its node count"):
        specfx.speculate(target, draft=target, tree=SIX, num_speculative_tokens=2, compile=False)


# --------------------------------------------------------------------------- compiled
def test_compiled_tree_round_is_one_graph_without_recompiles(one_thread):
    """One round graph (fullgraph) with no host-sync ops; a second call with another prompt
    length and max_new_tokens reuses it (one round compile event). These are properties of
    the captured graph, so the passes run without Inductor (``specfx_eager``); the Inductor
    compile of a tree round is in tests/conformance/test_conformance.py (gemma2)."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, tree=TREES["7"], num_speculative_tokens=7, backend="specfx_eager")
    for length, new in [(9, 20), (13, 26)]:
        ids = prompt(length, seed=length)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
    rounds = [e for e in spec.compile_events if e.key[0] == "round"]
    assert len(rounds) == 1 and TREES["7"] in rounds[0].key
    assert len(spec.graphs) == 1
    graph = spec.graphs[0]
    assert offending_nodes(graph.graph_module) == []
    ops = " ".join(graph.ops)
    for forbidden in ("nonzero", ".item", ".tolist", "masked_select"):
        assert forbidden not in ops
