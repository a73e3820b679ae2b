"""EAGLE-3 heads (``specfx.models.eagle3``, ``draft="eagle3:DIR"``) on tiny random targets.

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
from specfx.models.eagle3 import Eagle3
from specfx.models.tiny import tiny_causal_lm
from specfx.tree import TokenTree
from tests.conftest import left_padded, prompt
from tests.test_lossless import NEW, ROWS, _chisquare, _exact

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "mixtral")
LAYERS = 4  # tiny targets: the three taps below are distinct layers
TAPS = [1, 2, 3]  # inputs of decoder layers 1, 2, 3 (vLLM's convention)
DRAFT_VOCAB = 100  # of the tiny targets' 128: a reduced draft vocabulary everywhere
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])

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
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_chain_and_tree(arch, head_dir, one_thread):
    target = _target(arch)
    path = head_dir(arch)
    for shape in (dict(num_speculative_tokens=3), dict(tree=TREE)):
        spec = specfx.speculate(target, draft=f"eagle3:{path}", compile=False, **shape)
        assert isinstance(spec.drafter, Eagle3) and spec.drafter.taps == ("layer:1", "layer:2", "layer:3")
        for length, new in [(1, 9), (12, 20)]:
            _assert_greedy_equal(target, spec, prompt(length, seed=length), new=new)
        _assert_greedy_equal(target, spec, *_left_padded_batch())


def test_the_user_model_is_untouched_and_shared_not_copied(head_dir, one_thread):
    target = _target("llama")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    spec = specfx.speculate(target, draft=Eagle3(head_dir("llama")), num_speculative_tokens=2, compile=False)
    _assert_greedy_equal(target, spec, prompt(7, seed=3))
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
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
    hidden = feat + out
    y = _rms(hidden, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    return hidden + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def _ref_draft_logits(cfg, w, out):
    return _rms(out, w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T  # [.., V_draft]


def _read(path):
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


class _Reference:
    """The head's drafts after a committed sequence, recomputed from scratch: the target's
    hidden states over the committed prefix (HF's own forward), fc over the tapped layers,
    then the midlayer over all entries with a causal mask, one entry per draft step."""

    def __init__(self, target, path):
        self.target, (self.cfg, self.w) = target, _read(path)
        self.table = target.get_input_embeddings().weight  # raw lookup: no model-specific scaling

    def committed(self, seq: list[int]):
        """Entries 1..L for committed tokens ``seq`` (the last one pending at L): tokens, features."""
        ids = torch.tensor([seq])
        with torch.no_grad():
            hs = self.target(ids[:, :-1], output_hidden_states=True).hidden_states
        taps = torch.cat([hs[k] for k in self.cfg["eagle_aux_hidden_state_layer_ids"]], -1)
        return list(seq[1:]), taps @ self.w["fc.weight"].T  # [1, L, H]: entry t reads position t - 1

    def last_output(self, tokens: list[int], feats):
        n = len(tokens)
        pos = torch.arange(1, n + 1).unsqueeze(0)
        causal = torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)
        emb = F.embedding(torch.tensor([tokens]), self.table)
        with torch.no_grad():
            return _ref_layer(self.cfg, self.w, emb, feats, pos, causal)[:, -1:]  # [1, 1, H]

    def target_ids(self, draft_ids):
        return draft_ids + self.w["d2t"][draft_ids]

    def chain(self, seq, k):
        tokens, feats = self.committed(seq)
        drafts = []
        for _ in range(k):
            out = self.last_output(tokens, feats)
            token = int(self.target_ids(_ref_draft_logits(self.cfg, self.w, out).argmax(-1)))
            drafts.append(token)
            tokens, feats = tokens + [token], torch.cat([feats, out], 1)  # the output before norm is fed back
        return drafts

    def tree(self, seq, tree: TokenTree):
        """Node tokens: the children of a node are its top-ranked draft tokens, a node's entry
        reads its parent's output."""
        tokens, feats = self.committed(seq)
        parents, ranks = tree.parents, tree.ranks
        paths = {0: (tokens, feats)}  # node -> the entries up to and including its own
        outs = {}  # node -> its entry's output
        nodes = [0] * (tree.size + 1)
        for n in range(tree.size + 1):
            if n > 0:
                tok, fe = paths[parents[n]]
                paths[n] = (tok + [nodes[n]], torch.cat([fe, outs[parents[n]]], 1))
            if tree.has_children(n):
                outs[n] = self.last_output(*paths[n])
                top = _ref_draft_logits(self.cfg, self.w, outs[n])[0, 0].topk(max(ranks) + 1).indices
                for m in range(1, tree.size + 1):
                    if parents[m] == n:
                        nodes[m] = int(self.target_ids(top[ranks[m - 1]]))
        return nodes[1:]


class _Recording(Eagle3):
    """Records, per round, the committed tokens, the pending positions and the proposals."""

    def propose(self, ctx):
        proposals, q = super().propose(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals, q

    def propose_tree(self, ctx):
        proposals = super().propose_tree(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2 scales its own embeddings; the head does not
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_proposals_equal_an_independent_reference_forward(arch, shape, head_dir, one_thread):
    target, path = _target(arch), head_dir(arch)
    drafter = _Recording(path)
    drafter.rounds = []
    kw = dict(num_speculative_tokens=3) if shape == "chain" else dict(tree=TREE)
    spec = specfx.speculate(target, draft=drafter, compile=False, **kw)
    ids, mask = left_padded(6, (0, 3), seed=5)
    new = 12
    _assert_greedy_equal(target, spec, ids, mask, new=new)
    reference = _Reference(target, path)
    prompt_lengths = mask.sum(dim=1).tolist()
    checked = 0
    for lengths, tokens, proposals in drafter.rounds:
        for b in range(ids.shape[0]):
            pending = int(lengths[b])
            if pending + 1 - prompt_lengths[b] >= new:
                continue  # a finished row, carried along
            seq = tokens[b, : pending + 1].tolist()
            expected = reference.chain(seq, 3) if shape == "chain" else reference.tree(seq, TREE)
            assert proposals[b].tolist() == expected
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
        o2 = _ref_layer(cfg, ww, torch.cat([e1, e2], 1), torch.cat([f1, o1[:, :-1]], 1), torch.cat([pos1, pos1[:, 1:]], 1), mask[None])
        loss = F.cross_entropy(_ref_draft_logits(cfg, ww, o1).flatten(0, 1), label[:, 1:].flatten()) + F.cross_entropy(
            _ref_draft_logits(cfg, ww, o2[:, n1:]).flatten(0, 1), label[:, 2:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_file({**w, **{k: v.detach().contiguous() for k, v in params.items()}}, path / "model.safetensors")
    return float(loss.detach())


def test_a_trained_head_is_accepted_at_depth_two(tmp_path, one_thread):
    """A head trained on the target's own continuations of these prompts drafts them well: its
    second proposals, drafted from its own first output, are accepted too."""
    target = _target("llama")
    Eagle3.random(target, layer_ids=TAPS, seed=2).save(tmp_path)
    prompts = prompt(6, batch=6, seed=11)
    assert _train(target, tmp_path, prompts, new=26) < 0.1
    for shape in (dict(num_speculative_tokens=3), dict(tree=TREE)):
        spec = specfx.speculate(target, draft=f"eagle3:{tmp_path}", compile=False, **shape)
        _assert_greedy_equal(target, spec, prompts, new=26)
        assert spec.stats.per_position[1] > 0.5 * spec.stats.per_position[0] > 0, spec.stats
        assert spec.stats.tokens_per_round > 2


# ----------------------------------------------------------------------------- compiled
@pytest.mark.compiled
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_compiled_round_is_one_graph_and_stays_warm(shape, head_dir, one_thread):
    target = _target("llama")
    kw = dict(num_speculative_tokens=3) if shape == "chain" else dict(tree=TREE)
    spec = specfx.speculate(target, draft=f"eagle3:{head_dir('llama')}", compile=True, **kw)
    ids, mask = left_padded(10, (0, 3), seed=7)
    _assert_greedy_equal(target, spec, ids, mask, new=16)
    assert [e.key[0] for e in spec.compile_events] == ["round"]
    ids, mask = left_padded(7, (2, 0), seed=8)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _assert_greedy_equal(target, spec, ids, mask, new=16)
    assert len(spec.compile_events) == 1  # warm: nothing recompiled


# ----------------------------------------------------------------------------- sampling
V = 6  # test_lossless's vocabulary, enumerated exactly


@pytest.mark.parametrize(("draft_vocab", "shape"), [(V, dict(num_speculative_tokens=2)), (4, dict(num_speculative_tokens=3)), (4, dict(tree=TREE))])
def test_sampling_matches_exact_distribution(draft_vocab, shape, tmp_path, one_thread):
    target = tiny_causal_lm("llama", vocab_size=V, num_layers=LAYERS, eos_token_id=None, initializer_range=0.12, seed=3)
    target.generation_config.eos_token_id = None
    Eagle3.random(target, draft_vocab_size=draft_vocab, layer_ids=TAPS, seed=5).save(tmp_path)
    prompt_ids = [1, 4, 2]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    spec = specfx.speculate(target, draft=Eagle3(tmp_path), compile=False, **shape)
    torch.manual_seed(99)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # accept and correction paths both exercised
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3
