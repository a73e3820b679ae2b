"""EAGLE-3 heads (``specfx.drafters.heads.eagle3``, ``draft="eagle3:DIR"``) on tiny random targets.

Every head here is written to a directory in the public layout (config.json and
model.safetensors) and loaded back by path. Random heads draft poorly, so most tests check the
machinery: greedy output equals ``model.generate()`` whatever the head proposes, sampling
follows the target's exact distribution, and the proposals are *exactly* those of an
independent plain-PyTorch forward of the layout (written below from the layout's definition,
reading the safetensors file; nothing from specfx). One head is trained here, on the target's
own hidden states and greedy continuations, so that it drafts well: it is accepted at depth 2,
which only works if the drafted entries read the right features at the right positions.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessorList

import specfx
from specfx.drafters.heads.eagle3 import Eagle3, resolve_taps
from specfx.testing.tiny import tiny_causal_lm
from specfx.trees.drafting import draft_levels
from specfx.trees.types import TokenTree
from tests.conftest import active_rounds, left_padded, prompt, tiered, unchanged
from tests.lossless.test_lossless import (
    NEW,
    ROWS,
    TREE_OPTIONS,
    _assert_both_paths_at_several_depths,
    _chisquare,
    _exact,
    _tree_samples,
)
from tests.unit.drafters.heads.test_eagle import _Reference as _EagleReference

# gpt2 has learned positions: the head's rotary is its own, so the target needs none
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "mixtral", "gpt2")
LAYERS = 4  # tiny targets: the three taps below are distinct layers
TAPS = [1, 2, 3]  # inputs of decoder layers 1, 2, 3 (vLLM's convention)
DRAFT_VOCAB = 100  # of the tiny targets' 128: a reduced draft vocabulary everywhere
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
DYNAMIC = TokenTree.eagle2(budget=8, depth=3, branching=3)  # EAGLE-2: grown per row and round
# num_speculative_tokens = a tree's node count pins it: every round, never "auto"'s K = 0
SHAPES = {
    "chain": dict(num_speculative_tokens=3),
    "tree": dict(tree=TREE, num_speculative_tokens=TREE.size),
    "dynamic": dict(tree=DYNAMIC, num_speculative_tokens=DYNAMIC.size),
}

# the engines' rules on these heads (SafeAILab reads no tap ids) are checked in test_head_engines.py
pytestmark = pytest.mark.filterwarnings("ignore::specfx.drafters.heads.checkpoint.HeadLayoutWarning")

_targets: dict = {}


def _target(arch: str = "llama", **kw):
    key = (arch, tuple(sorted(kw.items())))
    if key not in _targets:
        _targets[key] = tiny_causal_lm(arch, num_layers=kw.pop("num_layers", LAYERS), **kw)
    return _targets[key]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """``head_dir(arch, draft_vocab=DRAFT_VOCAB, **target_kw)``: the directory of a random head
    for that tiny target, saved once per module."""
    saved = {}

    def make(arch="llama", draft_vocab=DRAFT_VOCAB, seed=0, **kw):
        key = (arch, draft_vocab, seed, tuple(sorted(kw.items())))
        if key not in saved:
            path = tmp_path_factory.mktemp(f"eagle3-{arch}")
            Eagle3.random(_target(arch, **kw), draft_vocab_size=draft_vocab, seed=seed, layer_ids=TAPS).save(path)
            saved[key] = path
        return saved[key]

    return make


def _left_padded_batch(vocab=128):
    return left_padded(10, (4, 0, 7), seed=4, vocab=vocab)


def _assert_greedy_equal(target, spec, ids, mask=None, new=15):
    kw = dict(max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    if mask is not None:
        kw["attention_mask"] = mask
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))


# ----------------------------------------------------------------------------- greedy
# CI: llama (gemma2's embedding scale: the proposals reference test, which CI runs on gemma2); pytest --full: gemma2
@pytest.mark.parametrize("arch", tiered(ARCHS, (), ci=("llama",)))
def test_greedy_equals_generate_chain_and_trees(arch, head_dir, one_thread):
    target = _target(arch)
    path = head_dir(arch)
    # gemma2 (the default tier) runs every shape; the other families the dynamic tree, whose mask
    # goes through each family's attention like the others' (each shape costs its own captures)
    for shape in SHAPES.values() if arch == "gemma2" else [SHAPES["dynamic"]]:
        spec = specfx.speculate(target, draft=f"eagle3:{path}", compile=False, **shape)
        assert isinstance(spec.drafter, Eagle3) and spec.drafter.taps == ("layer:1", "layer:2", "layer:3")
        # every family: a one-token prompt and the left-padded batch; llama also a longer prompt
        for length, new in [(1, 9), (12, 20)] if arch == "llama" else [(1, 9)]:
            _assert_greedy_equal(target, spec, prompt(length, seed=length), new=new)
        _assert_greedy_equal(target, spec, *_left_padded_batch())


def test_the_user_model_is_untouched_and_shared_not_copied(head_dir, one_thread):
    target = _target("llama")
    with unchanged(target):
        spec = specfx.speculate(target, draft=Eagle3(head_dir("llama")), num_speculative_tokens=2, compile=False)
        _assert_greedy_equal(target, spec, prompt(7, seed=3))
    # the embedding is the target's table itself; the head's own parameters are not the target's
    assert spec.drafter.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    theirs = {p.data_ptr() for p in target.parameters()}
    assert not theirs & {p.data_ptr() for p in spec.drafter.head.parameters()}


# ----------------------------------------------------------------------------- the reference
def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotary(x, pos, theta):
    """x [B, T, heads, D] rotated by positions pos [B, T] (rotate-half convention)."""
    d = x.shape[-1]
    angle = pos.float()[..., None] / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    angle = torch.cat([angle, angle], -1)[:, :, None]  # [B, T, 1, D]
    return x * angle.cos() + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * angle.sin()


def _ref_layer(cfg, w, emb, feat, pos, mask):
    """The midlayer from the layout's definition: emb, feat [B, T, H] at positions pos [B, T],
    mask [1 or B, T, T] (query, key) -> the output (the next feature) [B, T, H]."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    p = "midlayer."
    x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"], eps), _rms(feat, w[p + "hidden_norm.weight"], eps)], -1)
    b, t, _ = x.shape
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(b, t, heads, d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(b, t, kv, d)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, t, kv, d)
    q, k = _rotary(q, pos, theta), _rotary(k, pos, theta)
    k, v = k.repeat_interleave(heads // kv, 2), v.repeat_interleave(heads // kv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    attn = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, heads * d) @ w[p + "self_attn.o_proj.weight"].T
    normed = x[..., h:]
    hidden = (
        normed if cfg.get("norm_before_residual") else feat
    ) + out  # vLLM's variant starts from the normed feature
    y = _rms(hidden, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    return hidden + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def _ref_draft_logits(cfg, w, out):
    return _rms(out, w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T  # [.., V_draft]


def _read(path):
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


class _Reference(_EagleReference):
    """The EAGLE reference's drafting (chain, static tree, EAGLE-2 growth: entry j pairs token
    j + 1 with the feature at j; drafted entries read the head's own output) with EAGLE-3's
    head: the target's hidden states over the committed prefix (HF's own forward), fc over the
    tapped layers, the midlayer over all entries with a causal mask, the LM head over the draft
    vocabulary mapped onto the target's (-inf elsewhere)."""

    def __init__(self, target, path):
        self.target, (self.cfg, self.w) = target, _read(path)
        self.table = target.get_input_embeddings().weight  # raw lookup: no model-specific scaling

    @torch.no_grad()
    def features(self, seq):
        hs = self.target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        return torch.cat([hs[k][0] for k in self.cfg["eagle_aux_hidden_state_layer_ids"]], -1) @ self.w["fc.weight"].T

    @torch.no_grad()
    def last_output(self, tokens, feats):
        n = len(tokens)
        pos = torch.arange(1, n + 1).unsqueeze(0)
        causal = torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)
        emb = F.embedding(torch.tensor([tokens]), self.table)
        return _ref_layer(self.cfg, self.w, emb, feats[None], pos, causal)[0, -1:]  # [1, H], before the norm

    @torch.no_grad()
    def logits(self, out):
        draft = _ref_draft_logits(self.cfg, self.w, out)[0]  # [V_draft]
        full = torch.full((self.cfg["vocab_size"],), float("-inf"))
        full[torch.arange(len(draft)) + self.w["d2t"]] = draft
        return full


def _recorded(drafter):
    """``drafter`` with its propose methods wrapped (on the instance) to record, per round, the
    pending positions, the committed tokens and the proposals (for a dynamic tree: the node
    tokens and parents); returns the list."""
    rounds = []

    def wrap(method):
        def recording(ctx):
            out = method(ctx)
            proposals = out[0] if isinstance(out, tuple) else out  # propose: (proposals, q)
            rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
            return out

        return recording

    drafter.propose, drafter.propose_tree = wrap(drafter.propose), wrap(drafter.propose_tree)
    dynamic = drafter.propose_dynamic_tree

    def recording_dynamic(ctx):
        tokens, parents = dynamic(ctx)
        rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), (tokens.clone(), parents.clone())))
        return tokens, parents

    drafter.propose_dynamic_tree = recording_dynamic
    return rounds


@pytest.mark.parametrize("arch", tiered(["llama", "gemma2"], ["llama"]))  # gemma2 scales its own embeddings; the head does not
@pytest.mark.parametrize("shape", tiered(["chain", "tree", "dynamic"], ["chain", "tree"]))
def test_proposals_equal_an_independent_reference_forward(arch, shape, head_dir, one_thread):
    _assert_proposals_equal_reference(_target(arch), head_dir(arch), shape)


@pytest.mark.full
def test_vllm_norm_before_residual_variant_equals_the_reference(head_dir, tmp_path, one_thread):
    path = _edited(head_dir("llama"), tmp_path / "variant", config={"norm_before_residual": True})
    _assert_proposals_equal_reference(_target("llama"), path, "chain")


def _assert_proposals_equal_reference(target, path, shape):
    drafter = Eagle3(path)
    rounds = _recorded(drafter)
    spec = specfx.speculate(target, draft=drafter, compile=False, **SHAPES[shape])
    ids, mask = left_padded(6, (0, 3), seed=5)
    new = 12
    _assert_greedy_equal(target, spec, ids, mask, new=new)
    reference = _Reference(target, path)
    checked = 0
    for b, seq, proposals in active_rounds(rounds, mask.sum(dim=1).tolist(), new):
        if shape == "dynamic":
            assert (proposals[0][b].tolist(), proposals[1][b].tolist()) == reference.dynamic(seq, DYNAMIC)
        else:
            assert proposals[b].tolist() == (reference.chain(seq, 3) if shape == "chain" else reference.tree(seq, TREE))
        checked += 1
    assert checked >= 10


# ----------------------------------------------------------------------------- a trained head
def _train(target, path, prompts, new: int, steps: int = 120):
    """Train the head at ``path`` in place (plain PyTorch on the layout's tensors, the target
    frozen) to predict the target's greedy continuations of ``prompts``: the first draft step
    from the target's features, the second from the head's own first output (EAGLE-3's
    training-time test), as SafeAILab trains it."""
    cfg, w = _read(path)
    with torch.no_grad():
        seqs = target.generate(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = target(seqs, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[k] for k in cfg["eagle_aux_hidden_state_layer_ids"]], -1)  # [N, T, 3H]
    label = out.logits.argmax(-1)  # [N, T]: the target's next token after each position
    table = target.get_input_embeddings().weight.detach()
    n, t = seqs.shape
    n1, n2 = t - 1, t - 2  # first-step entries at positions 1..T-1, second-step ones at 2..T-1
    pos1 = torch.arange(1, t).expand(n, -1)
    mask = torch.zeros(n1 + n2, n1 + n2, dtype=torch.bool)
    mask[:n1, :n1] = torch.ones(n1, n1, dtype=torch.bool).tril()
    for j in range(n2):  # the second-step entry at position j + 2 sees first-step entries before it, and itself
        mask[n1 + j, : j + 1] = True
        mask[n1 + j, n1 + j] = True
    params = {k: v.clone().requires_grad_(True) for k, v in w.items() if v.is_floating_point()}
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    for _ in range(steps):
        ww = {**w, **params}
        f1 = feats[:, :-1] @ ww["fc.weight"].T
        e1, e2 = F.embedding(seqs[:, 1:], table), F.embedding(seqs[:, 2:], table)
        o1 = _ref_layer(cfg, ww, e1, f1, pos1, mask[None, :n1, :n1])
        o2 = _ref_layer(
            cfg,
            ww,
            torch.cat([e1, e2], 1),
            torch.cat([f1, o1[:, :-1]], 1),
            torch.cat([pos1, pos1[:, 1:]], 1),
            mask[None],
        )
        loss = F.cross_entropy(_ref_draft_logits(cfg, ww, o1).flatten(0, 1), label[:, 1:].flatten()) + F.cross_entropy(
            _ref_draft_logits(cfg, ww, o2[:, n1:]).flatten(0, 1), label[:, 2:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_file({**w, **{k: v.detach().contiguous() for k, v in params.items()}}, path / "model.safetensors")
    return float(loss.detach())


@pytest.mark.full
def test_a_trained_head_is_accepted_at_depth_two(tmp_path, one_thread):
    """A head trained on the target's own continuations of these prompts drafts them well: its
    second proposals, drafted from its own first output, are accepted too."""
    target = _target("llama")
    Eagle3.random(target, layer_ids=TAPS, seed=2).save(tmp_path)
    prompts = prompt(6, batch=6, seed=11)
    assert _train(target, tmp_path, prompts, new=26) < 0.1
    for shape in SHAPES.values():
        spec = specfx.speculate(target, draft=f"eagle3:{tmp_path}", compile=False, **shape)
        _assert_greedy_equal(target, spec, prompts, new=26)
        assert spec.stats.per_position[1] > 0.5 * spec.stats.per_position[0] > 0, spec.stats
        assert spec.stats.tokens_per_round > 2


# ----------------------------------------------------------------------------- compiled
@pytest.mark.compiled
@pytest.mark.parametrize(  # both --full; tree: Inductor (about 45 s), in CI (the default tier lowers a
    # tree, early exit's, and taps, an MTP round's, elsewhere and traces EAGLE-3's tree in test_heads_compiled)
    "shape", [pytest.param("chain", marks=pytest.mark.full), pytest.param("tree", marks=[pytest.mark.full, pytest.mark.ci])]
)
def test_compiled_round_is_one_graph_and_stays_warm(shape, head_dir, one_thread):
    target = _target("llama")
    backend = "specfx" if shape == "tree" else "specfx_eager"  # Inductor once per head type in CI
    spec = specfx.speculate(target, draft=f"eagle3:{head_dir('llama')}", compile=True, backend=backend, background_compile=False, **SHAPES[shape])
    ids, mask = left_padded(10, (0, 3), seed=7)
    _assert_greedy_equal(target, spec, ids, mask, new=16)
    assert [e.key[0] for e in spec.compile_events] == ["round"]
    round_graph = max(spec.graphs, key=lambda g: g.nodes)
    # KV writes (keys, values): the verification in 4 target layers, the head's observe and its
    # draft forwards (K - 1 chained steps, or one per tree level with children), and for the
    # tree the accepted path's compaction in the 4 target layers (the head moves nothing)
    head_forwards = 1 + (2 if shape == "chain" else len(draft_levels(TREE)))
    assert dict(round_graph.report.sites)["check_static_kv"] == 2 * (
        LAYERS + head_forwards + (shape == "tree") * LAYERS
    )
    ids, mask = left_padded(7, (2, 0), seed=8)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _assert_greedy_equal(target, spec, ids, mask, new=16)
    assert len(spec.compile_events) == 1  # warm: nothing recompiled


# ----------------------------------------------------------------------------- sampling
V = 6  # test_lossless's vocabulary, enumerated exactly


def _sampling_target(draft_vocab: int, path):
    """test_lossless's target with LAYERS layers, and a random head for it saved at ``path``."""
    target = tiny_causal_lm("llama", vocab_size=V, num_layers=LAYERS, eos_token_id=None, initializer_range=0.12, seed=3)
    target.generation_config.eos_token_id = None
    Eagle3.random(target, draft_vocab_size=draft_vocab, layer_ids=TAPS, seed=5).save(path)
    return target, _exact(target, [1, 4, 2], LogitsProcessorList())


@pytest.mark.parametrize(("draft_vocab", "k"), tiered([(V, 2), (4, 3)], [(4, 3)], several=True))
def test_sampling_matches_exact_distribution(draft_vocab, k, tmp_path, one_thread):
    target, probs = _sampling_target(draft_vocab, tmp_path)
    drafter = Eagle3(tmp_path)
    rounds = _recorded(drafter)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=k, **TREE_OPTIONS)
    torch.manual_seed(99)
    out = spec.generate(torch.tensor([[1, 4, 2]]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # accept and correction paths both exercised
    assert _chisquare(out[:, 3:].tolist(), probs) > 1e-3
    # q is zero outside the draft vocabulary: nothing else is ever proposed
    drafted = torch.cat([proposals for _, _, proposals in rounds]).unique()
    in_vocab = torch.arange(draft_vocab) + _read(tmp_path)[1]["d2t"]
    assert set(drafted.tolist()) <= set(in_vocab.tolist()) and len(drafted) > 1


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param(TREE, id="static", marks=pytest.mark.full),
        pytest.param(TokenTree.eagle2(budget=6, depth=3, branching=2), id="dynamic", marks=pytest.mark.full),
    ],
)
def test_tree_sampling_with_a_reduced_draft_vocabulary_matches_exact_distribution(tree, tmp_path, one_thread):
    """Children are the head's top-ranked tokens over its 4-id draft vocabulary of the target's 6."""
    target, probs = _sampling_target(4, tmp_path)
    samples, stats = _tree_samples(target, Eagle3(tmp_path), tree)
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) > 1e-3


# ----------------------------------------------------------------------------- the layout
def test_save_round_trip_and_vllm_naming(head_dir, tmp_path, one_thread):
    path = head_dir("llama")
    cfg, tensors = _read(path)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == TAPS and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in TAPS]  # SGLang's convention
    assert cfg["vocab_size"] == 128 and "target_hidden_size" not in cfg  # SafeAILab then shares the target's embedding
    assert "embed_tokens.weight" not in tensors and tensors["t2d"].sum() == DRAFT_VOCAB
    assert tuple(tensors["fc.weight"].shape) == (64, 3 * 64) and tensors["d2t"].dtype == torch.int64
    head = Eagle3(path)
    again = head.save(tmp_path / "again")
    cfg2, tensors2 = _read(again)
    assert cfg2 == cfg and tensors2.keys() == tensors.keys()
    assert all(torch.equal(tensors[k], tensors2[k]) for k in tensors)
    # vLLM's converted checkpoints name the midlayer layers.0: the same head
    renamed = tmp_path / "vllm"
    renamed.mkdir()
    (renamed / "config.json").write_text(json.dumps(cfg))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, renamed / "model.safetensors")
    target = _target("llama")
    ids = prompt(9, seed=6)
    out = [specfx.speculate(target, draft=Eagle3(p), num_speculative_tokens=3, compile=False) for p in (path, renamed)]
    new = [spec.generate(ids, max_new_tokens=12) for spec in out]
    assert torch.equal(new[0], new[1]) and torch.equal(new[0], target.generate(ids, max_new_tokens=12))
    assert out[0].stats.per_position == out[1].stats.per_position
    # a bound head saves what it runs: its tensors, in the target's dtype
    cfg3, tensors3 = _read(out[0].drafter.save(tmp_path / "bound"))
    assert cfg3["eagle_aux_hidden_state_layer_ids"] == TAPS
    assert all(torch.equal(tensors[k], tensors3[k]) for k in tensors)


def test_tap_conventions():
    """vLLM's top-level ids are layer inputs; SpecForge/SGLang's nested ids are layer outputs
    (the input of the next layer); the default is the inputs of layers 2, L // 2, L - 3."""
    layers = 32
    expected = ("layer:2", "layer:16", "layer:29")
    assert resolve_taps({}, layers) == expected
    assert resolve_taps({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, layers) == expected
    assert resolve_taps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, layers) == expected
    both = {
        "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    assert resolve_taps(both, layers) == expected  # the top-level key (vLLM's) wins
    # the last layer's output (before the final norm) is id L, or L - 1 as an output id
    assert resolve_taps({"eagle_aux_hidden_state_layer_ids": [2, 16, 32]}, layers)[-1] == "last"
    assert resolve_taps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 31]}}, layers)[-1] == "last"
    assert resolve_taps({}, 7) == ("layer:2", "layer:3", "layer:4")


@pytest.mark.full
def test_default_taps_repeat_below_seven_layers_and_run_as_listed(tmp_path, one_thread):
    """The default taps 2, L // 2, L - 3 repeat a layer below 7 target layers (L = 4: [2, 2, 1],
    L = 5: [2, 2, 2], L = 6: [2, 3, 3]; SpecForge's default [1, L//2 - 1, L - 4] is the same states). SpecForge's
    HF capture concatenates them as listed, repeats included, and so does specfx: greedy output
    equals generate() and every proposal equals the reference's, which reads the listed states."""
    assert resolve_taps({}, 4) == ("layer:2", "layer:2", "layer:1")
    assert resolve_taps({}, 5) == ("layer:2",) * 3
    assert resolve_taps({}, 6) == ("layer:2", "layer:3", "layer:3")
    assert resolve_taps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]}}, 4) == resolve_taps({}, 4)
    with pytest.raises(ValueError, match=r"default taps .* \[2, 1, 0\]\) for this target lists distinct layers out of"):
        resolve_taps({}, 3)  # layer order (SafeAILab, vLLM, SGLang) or as listed (SpecForge)? refused, not guessed
    with pytest.raises(ValueError, match=r"the target has 2 decoder layers, too few for the default taps"):
        resolve_taps({}, 2)
    target = _target("llama")  # 4 layers
    Eagle3.random(target, draft_vocab_size=DRAFT_VOCAB, seed=4).save(tmp_path)  # no layer_ids: the default
    cfg, _ = _read(tmp_path)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    spec = specfx.speculate(target, draft=Eagle3(tmp_path), num_speculative_tokens=2, compile=False)
    assert spec.drafter.taps == ("layer:2", "layer:1")  # the target returns each state once
    _assert_proposals_equal_reference(target, tmp_path, "chain")


@pytest.mark.full
def test_a_head_with_its_own_hidden_size_brings_its_own_embedding(tmp_path, one_thread):
    """A 32-wide head for a 64-wide target (target_hidden_size 64): fc takes 3 x 64, the
    midlayer runs at 32 with its own embedding table; a copy of the target's table is shared."""
    target = _target("llama")
    small = _target("llama", hidden_size=32, intermediate_size=64, seed=1)
    Eagle3.random(small, draft_vocab_size=DRAFT_VOCAB, layer_ids=TAPS, seed=3).save(tmp_path)
    cfg, tensors = _read(tmp_path)
    cfg["target_hidden_size"] = 64
    tensors["fc.weight"] = torch.randn(32, 3 * 64, generator=torch.Generator().manual_seed(0)) * 0.1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"has hidden size 32 but the target's embedding has 64 columns; such a head must bring its own embed_tokens.weight",
    ):
        specfx.speculate(target, draft=Eagle3(tmp_path), compile=False)
    table = small.get_input_embeddings().weight.detach().clone()
    save_file({**tensors, "embed_tokens.weight": table}, tmp_path / "model.safetensors")
    spec = specfx.speculate(target, draft=Eagle3(tmp_path), num_speculative_tokens=3, compile=False)
    assert torch.equal(spec.drafter.embed_weight, table)
    _assert_greedy_equal(target, spec, *_left_padded_batch())
    cfg2, tensors2 = _read(spec.drafter.save(tmp_path / "again"))
    assert cfg2["target_hidden_size"] == 64 and torch.equal(tensors2["embed_tokens.weight"], table)
    # a checkpoint whose embed_tokens is the target's own table (SafeAILab saves its frozen copy): shared
    path = tmp_path / "copy"
    Eagle3.random(target, layer_ids=TAPS).save(path)
    _, tensors = _read(path)
    save_file(
        {**tensors, "embed_tokens.weight": target.get_input_embeddings().weight.detach()}, path / "model.safetensors"
    )
    spec = specfx.speculate(target, draft=Eagle3(path), num_speculative_tokens=2, compile=False)
    assert spec.drafter.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()


# ----------------------------------------------------------------------------- bad input
def _edited(src, dst, config=None, drop=(), tensors=None):
    """A copy of the head at ``src`` in ``dst`` with config keys replaced (None values removed),
    tensors dropped or replaced."""
    cfg, w = _read(src)
    for k, v in (config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    w = {k: v for k, v in {**w, **(tensors or {})}.items() if k not in drop}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(w, dst / "model.safetensors")
    return dst


BAD_HEADS = {
    "missing tensor": (
        dict(drop=["midlayer.mlp.down_proj.weight"]),
        r"missing 1 tensor\(s\) of its layout: midlayer.mlp.down_proj.weight",
    ),
    "no d2t": (dict(drop=["d2t"]), r"missing 1 tensor\(s\) of its layout: d2t"),
    "d2t size": (dict(tensors={"d2t": torch.zeros(90, dtype=torch.long)}), r"d2t has shape \[90\], expected \[100\]"),
    "d2t range": (
        dict(tensors={"d2t": torch.full((100,), 40, dtype=torch.long)}),
        r"d2t maps draft ids outside the target vocabulary of 128 ids",
    ),
    "t2d": (
        dict(tensors={"t2d": torch.ones(128, dtype=torch.bool)}),
        r"t2d \(shape \[128\]\) does not mark exactly the 100 target ids",
    ),
    "lm_head": (
        dict(tensors={"lm_head.weight": torch.zeros(90, 64)}),
        r"lm_head.weight has shape \[90, 64\], expected \[100, 64\] \(\[draft_vocab_size 100",
    ),
    "no hidden size": (dict(config={"hidden_size": None}), r"needs a positive int hidden_size"),
    "no vocab size": (dict(config={"vocab_size": None}), r"needs a positive int vocab_size"),
    "fc_norm": (
        dict(config={"fc_norm": True}),
        r"sets fc_norm=True: an RMSNorm on each tapped state before fc .* does not implement",
    ),
    "two layers": (
        dict(config={"num_hidden_layers": 2}),
        r"has 2 decoder layers .* specfx runs EAGLE-3 heads with one layer",
    ),
    "dynamic rope": (
        dict(config={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
        r"rotary scaling 'dynamic' changes with the sequence length",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_bad_checkpoints_are_clear_errors(case, head_dir, tmp_path):
    edit, match = BAD_HEADS[case]
    path = _edited(head_dir("llama"), tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=match):
        Eagle3(path)


BAD_FOR_TARGET = {
    "target hidden size": (dict(config={"target_hidden_size": 48}, tensors={"fc.weight": torch.zeros(64, 144)}),
                           r"reads target hidden states of size 48 .* has hidden size 64"),
    "layer ids out of range": (dict(config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), r"\[1, 2, 9\] .* out of range; the target has 4 decoder layers"),
    "nested ids out of range": (dict(config={"eagle_aux_hidden_state_layer_ids": None, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}}),
                                r"eagle_config.eagle_aux_hidden_state_layer_ids = \[0, 1, 4\] .* out of range"),
    "unsorted layer ids": (dict(config={"eagle_aux_hidden_state_layer_ids": [3, 1, 2]}), r"lists distinct layers out of ascending order"),
    "two ids for three taps": (dict(config={"eagle_aux_hidden_state_layer_ids": [1, 3]}), r"its fc takes 3 target hidden states but its config names 2 layers"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_FOR_TARGET))
def test_heads_for_another_target_are_clear_errors(case, head_dir, tmp_path):
    edit, match = BAD_FOR_TARGET[case]
    path = _edited(head_dir("llama"), tmp_path / "bad", **edit)
    target = _target("llama")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        specfx.speculate(target, draft=f"eagle3:{path}", compile=False)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_vocabulary_mismatch_is_a_clear_error(head_dir):
    with pytest.raises(ValueError, match=r"into a target vocabulary of 128 ids .* has 256"):
        specfx.speculate(_target("llama", vocab_size=256), draft=Eagle3(head_dir("llama")), compile=False)


def test_bad_paths_are_clear_errors(head_dir, tmp_path):
    with pytest.raises(ValueError, match=r"Eagle3\(path\): path is required"):
        Eagle3(None)
    with pytest.raises(ValueError, match=r"draft='eagle3' needs the head's checkpoint directory after a colon"):
        specfx.speculate(_target("llama"), draft="eagle3", compile=False)
    with pytest.raises(ValueError, match=r"is not an existing local directory .* specfx never downloads"):
        Eagle3(tmp_path / "nowhere")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((head_dir("llama") / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(
        ValueError,
        match=r"has no \*.safetensors weights. It has pytorch_model.bin \(pickle\), which specfx never loads",
    ):
        Eagle3(pickled)
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(_read(head_dir("llama"))[1], bare / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no config.json"):
        Eagle3(bare)


@pytest.mark.full
def test_the_head_follows_a_target_cast_after_speculate(head_dir, one_thread):
    """The generator reallocates after model.to(dtype); the head's own parameters follow."""
    target = tiny_causal_lm("llama", num_layers=LAYERS)
    spec = specfx.speculate(target, draft=Eagle3(head_dir("llama")), num_speculative_tokens=3, compile=False)
    ids = prompt(8, seed=2)
    _assert_greedy_equal(target, spec, ids)
    target.to(torch.float64)
    _assert_greedy_equal(target, spec, ids)
    assert {p.dtype for p in spec.drafter.head.parameters()} == {torch.float64}
    assert spec.drafter.embed_weight.dtype == torch.float64
