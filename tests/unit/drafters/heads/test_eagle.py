"""EAGLE-1/2 heads (``specfx.drafters.heads.eagle.Eagle``, ``draft="eagle:DIR"``).

Every head is saved to a directory in SafeAILab's layout and loaded back by path, as a user's
would be. Random heads draft nonsense, so greedy equality with ``model.generate()`` is what
they prove there; on a small vocabulary their drafts are accepted now and then, so rounds
commit 1..K+1 tokens and the cache protocol is exercised at every offset, which the reference
test checks proposal by proposal against a plain PyTorch forward of the head written here from
the layout. A head built to compute what a one-layer target computes is accepted at depth >= 2.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LogitsProcessorList

import specfx
from specfx.drafters.heads.checkpoint import HeadLayoutWarning, write_head
from specfx.drafters.heads.eagle import Eagle
from specfx.testing.tiny import tiny_causal_lm
from specfx.trees.types import TokenTree
from tests.conftest import INDUCTOR_IN_FULL, active_rounds, left_padded, prompt, tiered
from tests.lossless.test_lossless import NEW, ROWS, _chisquare, _exact

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "mixtral")
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
DYNAMIC = TokenTree.eagle2(budget=8, depth=3, branching=3)
# num_speculative_tokens = a tree's node count pins it: every round, never "auto"'s K = 0
MODES = {
    "chain": dict(num_speculative_tokens=3),
    "tree": dict(tree=TREE, num_speculative_tokens=TREE.size),
    "dynamic": dict(tree=DYNAMIC, num_speculative_tokens=DYNAMIC.size),
}

_targets = {}


def target_and_head(arch: str, tmp_path_factory, vocab: int = 128, **kw):
    """(target, directory of a random EAGLE head for it), cached per configuration."""
    key = (arch, vocab, tuple(sorted(kw.items())))
    if key not in _targets:
        target = tiny_causal_lm(arch, vocab_size=vocab, **kw)
        directory = tmp_path_factory.mktemp(f"eagle-{arch}")
        with warnings.catch_warnings():  # heads of non-Llama layers: the engines build a Llama layer (checked elsewhere)
            warnings.simplefilter("ignore", HeadLayoutWarning)
            Eagle.random(target, seed=1).save(directory)
        _targets[key] = (target, directory)
    return _targets[key]


def _unchanged(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    return lambda: all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("mode", tiered(sorted(MODES), ("chain",)))  # trees: the proposals tests; --full
@pytest.mark.parametrize("arch", tiered(ARCHS, ("llama",), ci=("gemma2",)))
def test_greedy_equals_generate(arch, mode, tmp_path_factory, one_thread):
    target, directory = target_and_head(arch, tmp_path_factory)
    unchanged = _unchanged(target)
    spec = specfx.speculate(target, draft=Eagle(directory), compile=False, **MODES[mode])
    assert spec.drafter.name == "eagle"
    for length, new in [(1, 9), (12, 21)]:
        ids = prompt(length, seed=length)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
    ids, mask = left_padded(10, (4, 0, 7), seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=15, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert unchanged()


# ------------------------------------------------------------------ an independent reference
class _Reference:
    """The head as plain PyTorch, from the files on disk: embed the tokens, concatenate the
    features, fc, the target's decoder-layer class without its input norm run over the whole
    sequence with a causal (windowed, for a sliding layer) mask, the target's LM head. Entry j
    pairs token j + 1 with the target's last hidden state (after the final norm) at j, at
    position j + 1; drafted entries read the head's own output at the previous position."""

    def __init__(self, target, directory, layer_class=None, layer_config=None):
        tensors = load_file(str(directory / "model.safetensors"))
        config = json.loads((directory / "config.json").read_text())
        h = target.config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.get("bias", True))  # SafeAILab's default: a bias
        self.fc.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("fc.")})
        layer_config = layer_config or target.config
        self.layer = (layer_class or type(target.model.layers[0]))(layer_config, 0)
        self.layer.input_layernorm = nn.Identity()
        self.layer.load_state_dict({k[9:]: v for k, v in tensors.items() if k.startswith("layers.0.")})
        self.layer.eval()
        types = getattr(layer_config, "layer_types", None)
        sliding = types[0] == "sliding_attention" if types else getattr(layer_config, "sliding_window", None) is not None
        self.window = layer_config.sliding_window if sliding else None
        self.target = target

    @torch.no_grad()
    def features(self, seq):
        return self.target(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]  # [n, H]

    @torch.no_grad()
    def last_output(self, tokens, feats):
        n = len(tokens)
        x = self.fc(torch.cat([self.target.get_input_embeddings()(torch.tensor([tokens])), feats[None]], dim=-1))
        i = torch.arange(n)
        visible = i[None, :] <= i[:, None]
        if self.window is not None:
            visible &= i[:, None] - i[None, :] < self.window
        mask = visible[None, None]
        if self.target.config._attn_implementation == "eager":
            mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
        pos = torch.arange(1, n + 1)[None]
        rope = self.target.model.rotary_emb(x, pos)
        out = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return (out[0] if isinstance(out, tuple) else out)[0, -1:]  # [1, H]

    @torch.no_grad()
    def logits(self, out):
        return self.target.get_output_embeddings()(out)[0]

    def chain(self, seq, k):
        tokens, feats = list(seq[1:]), self.features(seq[:-1])
        drafts = []
        for _ in range(k):
            out = self.last_output(tokens, feats)
            drafts.append(int(self.logits(out).argmax()))
            tokens, feats = tokens + drafts[-1:], torch.cat([feats, out])
        return drafts

    def tree(self, seq, tree: TokenTree):
        tokens, feats = list(seq[1:]), self.features(seq[:-1])
        state = {0: (tokens, feats, self.last_output(tokens, feats))}
        drafts = []
        for n in range(1, tree.size + 1):
            tokens, feats, out = state[tree.parents[n]]
            rank = tree.ranks[n - 1]
            drafts.append(int(self.logits(out).topk(rank + 1).indices[rank]))
            tokens, feats = tokens + drafts[-1:], torch.cat([feats, out])
            state[n] = (tokens, feats, self.last_output(tokens, feats))
        return drafts

    def dynamic(self, seq, spec):
        """EAGLE-2's growth for one row: the root's top k are the depth-1 candidates; at each
        depth the k best candidates by cumulative log-probability are expanded into their top
        k; the budget best of all candidates are the nodes, in candidate order. Returns
        (tokens, parents) with parents[0] = 0 for the root."""
        tokens, feats = list(seq[1:]), self.features(seq[:-1])
        root = (tokens, feats, self.last_output(tokens, feats))
        k = spec.branching

        def children(state, first_id, parent_id, score):
            top = self.logits(state[2]).float().log_softmax(-1).topk(k)
            return [(first_id + r, t, parent_id, score + s, state) for r, (s, t) in enumerate(zip(top.values, top.indices.tolist(), strict=True))]

        cands = children(root, 1, 0, 0.0)  # (id, token, parent id, score, parent's state)
        frontier = cands
        for _ in range(1, spec.depth):
            level = []
            for cid, token, _, score, (ptokens, pfeats, pout) in frontier:
                state = (ptokens + [token], torch.cat([pfeats, pout]))
                state += (self.last_output(*state),)
                level += children(state, len(cands) + len(level) + 1, cid, score)
            cands += level
            frontier = sorted(level, key=lambda c: -float(c[3]))[:k]
        chosen = sorted(sorted(cands, key=lambda c: -float(c[3]))[: spec.budget], key=lambda c: c[0])
        node = {c[0]: i + 1 for i, c in enumerate(chosen)}
        return [c[1] for c in chosen], [0] + [node.get(c[2], 0) for c in chosen]


class _Recording(Eagle):
    """Records, per round, the committed tokens, lengths and the proposals made."""

    def propose(self, ctx):
        proposals, q = super().propose(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals, q

    def propose_tree(self, ctx):
        proposals = super().propose_tree(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals

    def propose_dynamic_tree(self, ctx):
        proposals, parents = super().propose_dynamic_tree(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), (proposals.clone(), parents.clone())))
        return proposals, parents


def _check_against_reference(target, directory, mode, reference):
    """Generate with a recording head (greedy, left-padded batch of 2) and compare every
    round's proposals of every active row with ``reference``."""
    vocab, new = target.config.vocab_size, 26
    drafter = _Recording(directory)
    drafter.rounds = []
    spec = specfx.speculate(target, draft=drafter, compile=False, **MODES[mode])
    ids, mask = left_padded(6, (1, 3), seed=3, vocab=vocab)
    kw = dict(attention_mask=mask, max_new_tokens=new, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    checked = 0
    for b, seq, proposals in active_rounds(drafter.rounds, mask.sum(dim=1).tolist(), new):
        if mode == "dynamic":
            assert (proposals[0][b].tolist(), proposals[1][b].tolist()) == reference.dynamic(seq, DYNAMIC)
        else:
            expected = reference.chain(seq, 3) if mode == "chain" else reference.tree(seq, TREE)
            assert proposals[b].tolist() == expected
        checked += 1
    assert checked >= 12
    assert spec.stats.accepted > 0  # some rounds committed more than one token
    return drafter


@pytest.mark.parametrize("mode", tiered(sorted(MODES), ("chain", "tree")))
@pytest.mark.parametrize("arch", tiered(["llama", "mistral", "gemma2"], ["llama"]))
def test_proposals_equal_a_plain_pytorch_reference(arch, mode, tmp_path_factory, one_thread):
    """Small vocabulary: random drafts are accepted often enough that rounds commit several
    tokens; a left-padded batch; mistral's and gemma2's layer 0 slides a window of 8."""
    target, directory = target_and_head(arch, tmp_path_factory, vocab=8, eos_token_id=None)
    _check_against_reference(target, directory, mode, _Reference(target, directory))


def test_a_dense_head_on_a_moe_target_is_safeailabs_llama_layer(tmp_path, one_thread):
    """SafeAILab's EAGLE code builds a dense Llama layer whatever the target, so its Mixtral
    heads hold mlp.gate_proj/up_proj/down_proj, not experts: such a head runs as transformers'
    LlamaDecoderLayer sized like the target (full attention), with the target's rotary."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    target = tiny_causal_lm("mixtral", vocab_size=8, eos_token_id=None)
    dense = Eagle.random(tiny_causal_lm("llama", vocab_size=8), seed=3, fc_bias=True).state_dict()  # tiny mixtral's sizes
    write_head(tmp_path, {"hidden_size": 64, "vocab_size": 8, "num_hidden_layers": 1, "bias": True}, dense)
    c = target.config
    config = LlamaConfig(hidden_size=64, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                         vocab_size=8)  # fmt: skip
    config._attn_implementation = "sdpa"
    reference = _Reference(target, tmp_path, LlamaDecoderLayer, config)
    drafter = _check_against_reference(target, tmp_path, "chain", reference)
    assert type(drafter.layer) is LlamaDecoderLayer


# ------------------------------------------------------------------ a head that agrees
def _agreeing_pair(tmp_path):
    """A one-layer llama target whose embedding rows have RMS 1 (so its input norm, at weight
    1, is the identity), and a head that computes that target's layer: fc = [I | 0] passes the
    token's embedding through, the layer is the target's layer 0. The head misses only the
    target's attention to position 0 (its slot 0 holds no entry), and the final norm (weight
    1, so a positive scale, which argmax ignores): it agrees with the target most of the time."""
    target = tiny_causal_lm("llama", num_layers=1, seed=2)
    with torch.no_grad():
        w = target.model.embed_tokens.weight
        w.copy_(w / w.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6))  # the padding row stays 0
    h = target.config.hidden_size
    tensors = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1), "fc.bias": torch.zeros(h)}
    layer = target.model.layers[0].state_dict()
    tensors.update({f"layers.0.{k}": v for k, v in layer.items() if not k.startswith("input_layernorm.")})
    write_head(tmp_path, {"hidden_size": h, "vocab_size": 128, "num_hidden_layers": 1, "bias": True}, tensors)
    return target, tmp_path


@pytest.mark.parametrize("mode", tiered(sorted(MODES), ("chain", "tree")))
def test_a_head_that_agrees_is_accepted_at_depth_two_and_more(mode, tmp_path, one_thread):
    target, directory = _agreeing_pair(tmp_path)
    spec = specfx.speculate(target, draft=f"eagle:{directory}", compile=False, **MODES[mode])
    ids = prompt(12, batch=2, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=40), target.generate(ids, max_new_tokens=40))
    stats = spec.stats
    assert stats.per_position[1] > 0 and stats.per_position[2] > 0  # depths 2 and 3 reached
    assert stats.tokens_per_round > 2.0


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize("mode", tiered(sorted(MODES), (), ci=("chain",)))
def test_sampling_matches_exact_distribution(mode, tmp_path_factory, one_thread):
    target, directory = target_and_head("llama", tmp_path_factory, vocab=6, seed=3, eos_token_id=None, initializer_range=0.12)
    target.generation_config.eos_token_id = None
    prompt_ids = [1, 4, 2]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    spec = specfx.speculate(target, draft=Eagle(directory), compile=False, **MODES[mode])
    torch.manual_seed(99)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # accept and correction paths both exercised
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


# ------------------------------------------------------------------ the layout
def test_save_and_load_round_trip(tmp_path, one_thread):
    target = tiny_causal_lm("qwen2")
    head = Eagle.random(target, seed=5, fc_bias=True)  # SafeAILab's shape: a bias on fc
    with pytest.warns(HeadLayoutWarning) as warned:  # vLLM drops a nonzero fc bias; SGLang q/k/v-only biases
        head.save(tmp_path / "a")
    assert "vLLM: its EAGLE fc has no bias" in str(warned[0].message) and "SGLang:" in str(warned[0].message)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 64 and config["qkv_bias"] is True
    assert "bias" not in config  # vLLM and SGLang would read it as attention biases
    assert config["architectures"] == ["LlamaForCausalLMEagle", "LlamaForCausalLM"]  # a Llama layer with q/k/v biases
    names = set(load_file(str(tmp_path / "a" / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.bias", "layers.0.mlp.down_proj.weight"} <= names
    assert not any("input_layernorm" in n or n.startswith(("embed_tokens", "lm_head")) for n in names)
    loaded = Eagle(tmp_path / "a")
    assert loaded.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in loaded.state_dict().items())
    spec = specfx.speculate(target, draft=loaded, num_speculative_tokens=2, compile=False)
    assert spec.drafter.embed is target.get_input_embeddings()  # shared, not copied
    assert spec.drafter.lm_head is target.get_output_embeddings()
    with pytest.warns(HeadLayoutWarning):
        loaded.save(tmp_path / "b")  # from the built modules
    again = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert again.keys() == names and all(torch.equal(again[k], head.state_dict()[k]) for k in names)


def test_head_follows_the_target_dtype_and_leaves_the_target_alone(tmp_path_factory, one_thread):
    _, directory = target_and_head("llama", tmp_path_factory)  # saved in float32
    target = tiny_causal_lm("llama", dtype=torch.bfloat16)
    unchanged = _unchanged(target)
    spec = specfx.speculate(target, draft=f"eagle:{directory}", num_speculative_tokens=2, compile=False)
    head = spec.drafter
    assert {p.dtype for m in (head.fc, head.layer) for p in m.parameters()} == {torch.bfloat16}
    ids = prompt(5)
    assert torch.equal(spec.generate(ids, max_new_tokens=6), target.generate(ids, max_new_tokens=6))  # no near-tie here
    assert unchanged() and target.dtype == torch.bfloat16


def test_an_embedding_in_the_checkpoint_is_only_shape_checked(tmp_path, one_thread):
    target = tiny_causal_lm("llama")
    head = Eagle.random(target)
    tensors = dict(head.state_dict(), **{"embed_tokens.weight": torch.zeros(128, 64)})
    write_head(tmp_path, head.checkpoint.config, tensors)
    spec = specfx.speculate(target, draft=Eagle(tmp_path), num_speculative_tokens=2, compile=False)
    ids = prompt(7, seed=3)
    assert torch.equal(spec.generate(ids, max_new_tokens=8), target.generate(ids, max_new_tokens=8))
    write_head(tmp_path, head.checkpoint.config, dict(tensors, **{"embed_tokens.weight": torch.zeros(100, 64)}))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \[100, 64\], expected \[128, 64\]"):
        specfx.speculate(target, draft=Eagle(tmp_path), compile=False)


# ------------------------------------------------------------------ bad input
def _saved(tmp_path, target, edit=None, config_edit=None):
    head = Eagle.random(target)
    tensors, config = head.state_dict(), dict(head.checkpoint.config)
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(config)
    write_head(tmp_path, config, tensors)
    return tmp_path


def test_hidden_size_mismatch(tmp_path):
    target = tiny_causal_lm("llama")
    other = tiny_causal_lm("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    directory = _saved(tmp_path, other)
    unchanged = _unchanged(target)
    with pytest.raises(ValueError, match=r"trained for a target with hidden size 32 .* has 64"):
        specfx.speculate(target, draft=Eagle(directory), compile=False)
    _saved(tmp_path, other, config_edit=lambda c: c.pop("hidden_size"))  # then the weights say so
    with pytest.raises(ValueError, match=r"fc.weight has shape \[32, 64\], expected \[64, 128\] \(\[hidden, 2 \* hidden\]"):
        specfx.speculate(target, draft=Eagle(directory), compile=False)
    assert unchanged()


def test_vocab_mismatch(tmp_path):
    target = tiny_causal_lm("llama")
    directory = _saved(tmp_path, tiny_causal_lm("llama", vocab_size=256))
    with pytest.raises(ValueError, match=r"trained for a target with vocabulary size 256 .* has 128"):
        specfx.speculate(target, draft=Eagle(directory), compile=False)


def test_missing_and_foreign_tensors(tmp_path):
    target = tiny_causal_lm("llama")
    directory = _saved(tmp_path, target, edit=lambda t: t.pop("layers.0.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\) of its layout: layers.0.mlp.down_proj.weight"):
        specfx.speculate(target, draft=Eagle(directory), compile=False)
    _saved(tmp_path, tiny_causal_lm("qwen2"))  # q/k/v biases a llama layer does not have
    with pytest.raises(ValueError, match=r"has tensors this target's decoder layer .* does not: layers.0.self_attn.k_proj.bias"):
        specfx.speculate(target, draft=Eagle(directory), compile=False)
    _saved(tmp_path, target, edit=lambda t: t.update({"layers.1.mlp.down_proj.weight": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"EAGLE-1/2 heads have one \(layers.0\)"):
        Eagle(directory)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights. It has pytorch_model.bin \(pickle\), which specfx never loads"):
        Eagle(tmp_path)


def test_no_path_and_nonexistent_path(tmp_path):
    target = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match=r"draft='eagle' needs the head's checkpoint directory after a colon"):
        specfx.speculate(target, draft="eagle", compile=False)
    with pytest.raises(ValueError, match=r"Eagle\(path\): path is required"):
        Eagle(None)
    with pytest.raises(ValueError, match=r"is not an existing local directory .* specfx never downloads"):
        specfx.speculate(target, draft=f"eagle:{tmp_path / 'nowhere'}", compile=False)


def test_target_without_rotary_positions_is_refused(tmp_path):
    directory = _saved(tmp_path, tiny_causal_lm("llama"))
    target = tiny_causal_lm("gpt2")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no rotary position embedding"):
        specfx.speculate(target, draft=Eagle(directory), compile=False)


# ------------------------------------------------------------------ compiled
@pytest.mark.parametrize(
    ("mode", "backend"),
    tiered([(mode, "specfx_eager") for mode in sorted(MODES)], [("dynamic", "specfx_eager")], several=True)
    + [pytest.param("dynamic", "specfx", marks=INDUCTOR_IN_FULL)],
)
def test_compiled_one_graph_and_stays_warm(mode, backend, tmp_path_factory, one_thread):
    target, directory = target_and_head("llama", tmp_path_factory)
    # traced by Dynamo and the passes only (specfx_eager); --full also lowers the dynamic tree (the
    # largest round) with Inductor (EAGLE-3's tree round is the default tier's Inductor-compiled head):
    # tests/unit/drafters/heads/test_heads_compiled.py says how to run every head and shape under Inductor
    spec = specfx.speculate(target, draft=Eagle(directory), compile=True, compile_prefill=True, backend=backend, background_compile=False, **MODES[mode])
    ids = prompt(6, batch=2, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=12), target.generate(ids, max_new_tokens=12))
    assert len(spec.graphs) == 2  # one prefill graph, one round graph (fullgraph: no breaks)
    ids = prompt(9, batch=2, seed=2)
    assert torch.equal(spec.generate(ids, max_new_tokens=10), target.generate(ids, max_new_tokens=10))
    assert len(spec.graphs) == 2  # warm: nothing recompiled
