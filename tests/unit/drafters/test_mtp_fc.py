"""MTP on hybrid targets whose checkpoints ship MTP layers transformers drops: Qwen3-Next, Qwen3.5 and
Qwen3.5-MoE (``ArchSpec.mtp_layout = "qwen3_next"``; decision 86) and BailingHybrid (Ling 3; ``"bailing"``,
decision 95). specfx builds the layers from the target's own classes (its decoder layer as a
full-attention layer, its RMSNorm) and the checkpoint's MTP tensors; they keep attention KV only, so the
target's recurrent state is rolled back as for any drafter reading its hidden states (decision 82).

The reference is a restatement of vLLM's MTP forward written here from the facts of
vllm-project/vllm at pinned commits (no code copied):

* ``vllm/model_executor/models/qwen3_next_mtp.py`` @ ffdc985737c94233f2c88629c4450022e5bf4925
  (``Qwen3NextMultiTokenPredictor``; ``qwen3_5_mtp.py`` @ 9a4f2b9f6c0912ea45bed24fe3d5ef414fc9d194 is
  the same for Qwen3.5): ``e = pre_fc_norm_embedding(embed(token))``, ``h = pre_fc_norm_hidden(hidden)``,
  ``x = fc(cat([e, h]))``, one decoder layer of type full_attention (``layers[step % n]``), then
  ``norm``; the LM head is the target's; the loader maps ``mtp.*`` to the predictor.
* ``vllm/model_executor/models/qwen3_next.py`` @ 002d6073aa034d4f5545d45021b0e56d1f3c3593: the RMSNorm
  is ``GemmaRMSNorm`` (scale ``1 + weight``, in float32); attention projects ``q`` and a gate per head
  (``[q | gate]`` within each head), RMSNorms ``q`` and ``k`` per head, applies NeoX rotary to the first
  ``partial_rotary_factor * head_dim`` dims, attends causally, multiplies by ``sigmoid(gate)`` and
  projects; the MoE layer routes by ``softmax`` top-k, renormalised unless ``norm_topk_prob`` is False,
  over SiLU-gated experts, plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``; a layer is
  MoE when its index (0 for ``mtp.layers.0``) is not in ``mlp_only_layers`` and
  ``(index + 1) % decoder_sparse_step == 0``.
* vLLM's proposer (``vllm/v1/spec_decode/eagle.py``) pairs the token at position q with the hidden state
  at q - 1 and runs the MTP layer at the *hidden state's* position (HF's ``MtpModel`` and specfx use the
  token's): attention depends on relative positions only, so both give the same drafts (to rounding).

The restatement reads the raw checkpoint tensors (per-expert names, as transformers saves these types),
so it checks specfx's loading too. Breaking specfx's layer (the embedding/hidden concatenation swapped,
the final norm dropped) fails the numerics test.

The ``"bailing"`` layout's reference, from vllm-project/vllm at pinned commits:

* ``vllm/model_executor/models/bailing_moe_v3_mtp.py`` @ 017ad415dee415ffef1431b820fbeca779c5a779
  (``BailingMoeV3MultiTokenPredictorLayer``): MTP layer ``i`` is checkpoint layer ``num_hidden_layers + i``
  (``model.layers.{N + i}.*``); ``e = enorm(embed(token))``, ``h = hnorm(hidden)`` (RMSNorm, scale
  ``weight``), ``x = eh_proj(cat([e, h]))``, then ``input_layernorm``, MLA attention, residual,
  ``post_attention_layernorm``, the MoE block (always MoE), residual, and ``final_layernorm``: the LM head's
  input (the target's head) and the next step's hidden state; the embedding at position 0 is not zeroed.
* ``bailing_moe_v3.py`` @ 1310e2a6f71b74e880fc4a254cfaf7e1337d7301: checkpoint names ``.attention.`` are
  the model's ``.self_attn.``; ``mlp.gate.e_score_correction_bias`` is also stored as ``expert_bias``.

The restated wrapper (norms, concatenation order, projection, final norm, names) runs around
transformers' own BailingHybrid decoder layer (MLA with its head-wise gate, the grouped sigmoid router),
loaded by the test from the raw tensors under transformers' names (``attention.dense`` is its
``self_attn.o_proj``) over the whole window from scratch: the layer's internals are transformers'
(the same code as the target's own layers, which the conformance tests compare with ``generate()``);
what specfx adds (layout, names, cache, mask, rope, chaining) is checked against the restatement.
"""

import copy
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import specfx
from specfx.drafters import mtp as mtp_module
from specfx.drafters.mtp_fc import LAYOUTS, EhMtpLayers, FcMtpLayers
from specfx.model.architectures import ARCHITECTURES, installed
from specfx.testing.mtp import fc_mtp_checkpoint
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm
from tests.conftest import active_rounds, left_padded, prompt, tiered

# every type of this file's layouts (DeepSeek-V4's: tests/unit/drafters/test_mtp_v4.py)
ARCHS = [a for a, spec in ARCHITECTURES.items() if spec.mtp_layout in LAYOUTS and installed(a)]
VOCAB = 8  # random MTP layers then agree with the target often enough for rounds that accept some

_checkpoints = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch, m=1)``: ``(target loaded from its checkpoint, the random MTP layers saved in it)``."""

    def get(arch: str, m: int = 1):
        if (arch, m) not in _checkpoints:
            _checkpoints[arch, m] = fc_mtp_checkpoint(arch, m, tmp_path_factory.mktemp(f"{arch}_{m}"), vocab=VOCAB)
        return _checkpoints[arch, m]

    return get


# ----------------------------------------------------------------- vLLM's forward, restated
class _Restated:
    """vLLM's Qwen3-Next / Qwen3.5 MTP over raw checkpoint tensors (see the module docstring)."""

    EMBED = "model.embed_tokens.weight"

    def __init__(self, target):
        path = target.config.name_or_path
        with safe_open(f"{path}/model.safetensors", framework="pt") as f:
            self.w = {k: f.get_tensor(k) for k in f.keys()}
        self.c = target.config
        self.embed = self.w[self.EMBED]
        self.head = self.w.get("lm_head.weight", self.embed)
        self.target = target

    def norm(self, x, name):  # GemmaRMSNorm: x / rms(x) * (1 + w), in float32
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)
        return (x32 * (1.0 + self.w[name].float())).to(x.dtype)

    def rotary(self, x, positions):  # x [T, heads, d]; NeoX style on the first rotary_dim dims
        rope = self.c.rope_parameters
        dim = int(self.c.head_dim * rope.get("partial_rotary_factor", 1.0))
        inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        freqs = positions.float()[:, None] * inv[None]  # [T, dim / 2]
        cos, sin = freqs.cos().repeat(1, 2)[:, None], freqs.sin().repeat(1, 2)[:, None]  # [T, 1, dim]
        rot, rest = x[..., :dim], x[..., dim:]
        half = rot.shape[-1] // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    def attention(self, x, positions, p):
        c, w = self.c, self.w
        heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        t = x.shape[0]
        q_gate = (x @ w[p + "q_proj.weight"].T).view(t, heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        k = (x @ w[p + "k_proj.weight"].T).view(t, kv, d)
        v = (x @ w[p + "v_proj.weight"].T).view(t, kv, d)
        q = self.rotary(self.norm(q, p + "q_norm.weight"), positions)
        k = self.rotary(self.norm(k, p + "k_norm.weight"), positions)
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v) * torch.sigmoid(gate)
        return out.reshape(t, heads * d) @ w[p + "o_proj.weight"].T

    def mlp(self, x, p):
        w = self.w
        return (torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[
            p + "down_proj.weight"
        ].T

    def moe(self, x, p):
        probs = (x @ self.w[p + "gate.weight"].T).float().softmax(-1)
        top, experts = probs.topk(self.c.num_experts_per_tok, dim=-1)
        if getattr(self.c, "norm_topk_prob", None) is not False:
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for weight, e in zip(top[t], experts[t].tolist(), strict=True):
                out[t] += weight.to(x.dtype) * self.mlp(x[t : t + 1], f"{p}experts.{e}.")[0]
        shared = self.mlp(x, p + "shared_expert.") * torch.sigmoid(x @ self.w[p + "shared_expert_gate.weight"].T)
        return out + shared

    def layer(self, x, positions, i):
        p = f"mtp.layers.{i}."
        x = x + self.attention(self.norm(x, p + "input_layernorm.weight"), positions, p + "self_attn.")
        h = self.norm(x, p + "post_attention_layernorm.weight")
        moe = (i not in (getattr(self.c, "mlp_only_layers", None) or [])) and getattr(self.c, "num_experts", 0) > 0
        moe = moe and (i + 1) % getattr(self.c, "decoder_sparse_step", 1) == 0
        return x + (self.moe(h, p + "mlp.") if moe else self.mlp(h, p + "mlp."))

    @torch.no_grad()
    def step(self, tokens, hidden, positions, step: int = 0):
        """``tokens [T]`` at q, ``hidden [T, H]`` at q - 1, ``positions [T]`` (the hidden's, as vLLM's
        proposer gives them), one causal window -> (normed output ``[T, H]``, logits ``[T, V]``)."""
        n = sum(1 for k in self.w if k.startswith("mtp.layers.") and k.endswith(".input_layernorm.weight"))
        e = self.norm(self.embed[tokens], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden, "mtp.pre_fc_norm_hidden.weight")
        x = torch.cat([e, h], dim=-1) @ self.w["mtp.fc.weight"].T
        out = self.norm(self.layer(x, positions, step % n), "mtp.norm.weight")
        return out, out @ self.head.T

    def greedy_chain(self, target, committed: list[int], k: int) -> list[int]:
        """The k drafts after ``committed`` (the last one pending): the target's last hidden states
        (after its final norm) over the prefix, then one restated MTP step per draft, each over the whole
        window from scratch (causal: earlier outputs are unchanged as the window grows)."""
        ids = torch.tensor([committed])
        with torch.no_grad():
            hidden = target.model(ids[:, :-1]).last_hidden_state[0]  # [n, H] at 0..n-1
        tokens, drafts = list(committed[1:]), []
        for _ in range(k):
            out, logits = self.step(torch.tensor(tokens), hidden, torch.arange(len(tokens)))
            drafts.append(int(logits[-1].argmax()))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts


class _RestatedBailing(_Restated):
    """vLLM's Bailing-MoE V3 MTP wrapper over raw checkpoint tensors, around transformers' decoder layer
    (see the module docstring)."""

    EMBED = "model.word_embeddings.weight"  # Ling's name for the embedding

    def norm(self, x, name):  # RMSNorm: x / rms(x) * w, in float32
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)
        return (x32 * self.w[name].float()).to(x.dtype)

    def decoder_layer(self, p):
        """transformers' decoder layer built as a full-attention MoE layer, loaded from the tensors under
        ``p`` renamed to transformers' names here, experts folded as its conversion folds them."""
        config = copy.deepcopy(self.c)
        config.num_hidden_layers, config.layer_types, config.mlp_layer_types = 1, ["full_attention"], ["sparse"]
        layer = type(self.target.model.layers[0])(config, 0).eval()
        own = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")
        state, experts = {}, {}
        for k, t in self.w.items():
            if not k.startswith(p) or k[len(p) :].startswith(own):
                continue
            k = k[len(p) :].replace("attention.dense.", "self_attn.o_proj.").replace("attention.", "self_attn.")
            k = k.replace("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias")
            if k.startswith("mlp.experts."):
                _, _, e, proj, _ = k.split(".")
                experts[int(e), proj] = t
            else:
                state[k] = t
        count = 1 + max(e for e, _ in experts)
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e, "gate_proj"], experts[e, "up_proj"]]) for e in range(count)]
        )
        state["mlp.experts.down_proj"] = torch.stack([experts[e, "down_proj"] for e in range(count)])
        layer.load_state_dict(state, strict=True)
        return layer

    @torch.no_grad()
    def step(self, tokens, hidden, positions, step: int = 0):
        c = self.c
        p = f"model.layers.{c.num_hidden_layers + step % c.num_mtp_layers}."
        e = self.norm(self.embed[tokens], p + "enorm.weight")
        h = self.norm(hidden, p + "hnorm.weight")
        x = (torch.cat([e, h], dim=-1) @ self.w[p + "eh_proj.weight"].T).unsqueeze(0)
        t = x.shape[1]
        causal = torch.zeros(1, 1, t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        rope = self.target.model.rotary_emb(x, positions.unsqueeze(0))
        out = self.decoder_layer(p)(
            x, attention_mask=causal, position_ids=positions.unsqueeze(0), position_embeddings=rope
        )
        out = self.norm(out[0], p + "final_layernorm.weight")
        return out, out @ self.head.T


def _restated(target) -> _Restated:
    return (
        _RestatedBailing(target)
        if ARCHITECTURES[target.config.model_type].mtp_layout == "bailing"
        else _Restated(target)
    )


# ----------------------------------------------------------------- (a) numerics
@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_layer_equals_restated_vllm_forward(arch, checkpoint, one_thread):
    """specfx's MTP layer (loaded by ``draft="mtp"`` from the checkpoint, run through the drafter's own
    cache, mask and rope) gives the logits of vLLM's forward restated over the raw checkpoint tensors."""
    target, _ = checkpoint(arch)
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=2, compile=False)
    drafter = spec.drafter
    assert type(drafter.mtp) is LAYOUTS[ARCHITECTURES[arch].mtp_layout]
    drafter.allocate(1, 64)
    t = 11
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (t,), generator=g)
    hidden = torch.randn(t, target.config.hidden_size, generator=g)
    pos = torch.arange(1, t + 1).unsqueeze(0)  # the tokens' positions (specfx's and HF's convention)
    with torch.no_grad():
        got = drafter._logits(drafter._layer(0, tokens.unsqueeze(0), hidden.unsqueeze(0), pos, pos), 0)[0]
    _, expected = _restated(target).step(tokens, hidden, torch.arange(t))  # vLLM's: the hidden's positions
    scale = expected.abs().max()
    assert scale > 1.0  # the logits are far from zero: a wrong layer could not hide in the tolerance
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)


# ----------------------------------------------------------------- (b) greedy equality
def _assert_equal_generate(spec, target, ids, mask, new):
    kw = dict(attention_mask=mask, max_new_tokens=new, pad_token_id=0)
    expected = target.generate(ids, **kw)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"


GREEDY = [(a, c) for a in ARCHS for c in (False, True)]  # compile=True: backend="specfx_eager"


@pytest.mark.parametrize(
    ("arch", "compile"),
    tiered(
        GREEDY,
        [("qwen3_next", False)],
        several=True,
        ci=[("qwen3_next", True), *[("bailing_hybrid", c) for c in (False, True)]],
    ),
)
def test_greedy_equals_generate_with_rounds_that_reject(arch, compile, checkpoint, one_thread):
    """Batch 1 and a left-padded batch of three, K = 3 past the one MTP layer (chained on its own
    output); random layers: most proposals are rejected (every such round rolls the state back), some
    accepted."""
    target, _ = checkpoint(arch)
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=3, compile=compile, backend="specfx_eager")
    assert spec.drafter.name == "mtp"
    _assert_equal_generate(spec, target, prompt(9, vocab=VOCAB, seed=1), None, 12)
    ids, mask = left_padded(10, [3, 0, 6], seed=2, vocab=VOCAB)
    _assert_equal_generate(spec, target, ids, mask, 12)
    assert 0 < spec.stats.accepted < spec.stats.proposed
    assert all(not m._forward_pre_hooks for m in target.modules())  # the rollback's hooks are gone


@pytest.mark.full
def test_two_mtp_layers_greedy_equals_generate(checkpoint, one_thread):
    """Two layers (no shipped checkpoint has more than one): depth i runs layer i, then the last chains."""
    target, _ = checkpoint("qwen3_next", 2)
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=4, compile=False)
    assert spec.drafter.num_layers == 2
    ids, mask = left_padded(10, [3, 0], seed=5, vocab=VOCAB)
    _assert_equal_generate(spec, target, ids, mask, 14)


@pytest.mark.full
@pytest.mark.compiled
def test_inductor_round_is_one_graph_and_equals_generate(checkpoint, one_thread):
    """Compiled with the default backend (Inductor): the MTP layers' draft steps and the target's tapped
    verify forward that returns the mixers' inputs (decision 82) are one round graph per batch bucket;
    batch 1, then two left-padded batches of one bucket, the second under ``error_on_recompile``, each
    equal to ``generate()`` with rounds that accept some proposals and reject most. Qwen3-Next's round
    compiles on torch 2.11 too (its row names no ``inductor_torch``, decision 84)."""
    target, _ = checkpoint("qwen3_next")
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=3)
    cases = (((prompt(9, vocab=VOCAB, seed=5), None), 12), (left_padded(10, [3, 0, 6], seed=2, vocab=VOCAB), 12))
    cases = (*cases, (left_padded(12, [2, 0, 5], seed=4, vocab=VOCAB), 10))
    for i, ((ids, mask), new) in enumerate(cases):
        with torch._dynamo.config.patch(error_on_recompile=i == 2):
            _assert_equal_generate(spec, target, ids, mask, new)
        assert 0 < spec.stats.accepted < spec.stats.proposed, f"case {i}"
    assert len(spec.graphs) == 2 and {g.compiler for g in spec.graphs} == {"inductor"}
    assert all(not m._forward_pre_hooks for m in target.modules())


# ----------------------------------------------------------------- (c) the round's proposals
class _Recording(specfx.MTP):
    def propose(self, ctx):
        proposals, q = super().propose(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals, q


@pytest.mark.parametrize("arch", tiered(ARCHS, ()))  # the default tier: the numerics and greedy tests
def test_proposals_equal_the_restated_greedy_chain_in_every_round(arch, checkpoint, one_thread):
    """Every round's K = 3 proposals, per row of a left-padded batch, equal vLLM's restated MTP chain run
    from scratch over the row's committed tokens: the drafter's cache, stash and chaining are exact
    whatever each round accepted."""
    target, _ = checkpoint(arch)
    drafter = _Recording()
    drafter.rounds = []
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=3, compile=False)
    ids, mask = left_padded(6, [1, 3], seed=7, vocab=VOCAB)
    new = 16
    _assert_equal_generate(spec, target, ids, mask, new)
    reference, checked = _restated(target), 0
    for b, committed, proposals in active_rounds(drafter.rounds, mask.sum(dim=1).tolist(), new):
        assert proposals[b].tolist() == reference.greedy_chain(target, committed, 3), (b, committed)
        checked += 1
    assert checked >= 10
    assert spec.stats.accepted > 0


# ----------------------------------------------------------------- loading and refusals
def test_experts_load_from_either_checkpoint_form(checkpoint, tmp_path, one_thread):
    """Per-expert tensors (how transformers saves Qwen3-Next) and fused ones (``experts.gate_up_proj``,
    as vLLM's Qwen3.5 MTP loader also reads) load to the same layers; the layers are the default drafter."""
    target, layers = checkpoint("qwen3_next")
    assert mtp_module.has_mtp(target)
    assert specfx.speculate(target, compile=False).drafter.name == "mtp"
    loaded = FcMtpLayers.from_checkpoint(target).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in layers.state_dict().items())
    tensors = load_file(f"{target.config.name_or_path}/model.safetensors")
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in tensors
    tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    tensors.update(layers.checkpoint_tensors(per_expert=False))
    target.config.save_pretrained(tmp_path)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fused = type(target).from_pretrained(tmp_path, attn_implementation="sdpa")
    loaded = FcMtpLayers.from_checkpoint(fused).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in layers.state_dict().items())


def test_a_checkpoint_without_mtp_tensors_or_a_config_without_the_count_is_a_clear_error(one_thread):
    no_weights = tiny_causal_lm("qwen3_next", mtp_num_hidden_layers=1, **STATEFUL_TINY["qwen3_next"])
    no_count = tiny_causal_lm("qwen3_next", **STATEFUL_TINY["qwen3_next"])
    cases = [
        (no_weights, r"declares 1 MTP layer\(s\) but its checkpoint .* holds no MTP weights \(mtp.fc.weight"),
        (no_count, r"has no MTP layers \(its config sets no mtp_num_hidden_layers or num_nextn_predict_layers\)"),
    ]
    for model, match in cases:
        assert not mtp_module.has_mtp(model)
        with pytest.raises(ValueError, match=match):
            specfx.speculate(model, draft="mtp", compile=False)
        assert specfx.speculate(model, compile=False).drafter.name != "mtp"


@pytest.mark.skipif(not installed("bailing_hybrid"), reason="transformers has no bailing_hybrid")
def test_bailing_layers_load_from_ling_or_transformers_names_and_a_missing_tensor_is_named(checkpoint, tmp_path):
    """The ``"bailing"`` layout reads Ling's names (``attention.dense``, ``mlp.gate.expert_bias``,
    per-expert tensors: how transformers writes a BailingHybrid checkpoint back) and transformers' own
    (``self_attn.o_proj``, ``e_score_correction_bias``, fused experts) to the same layers, the routers'
    biases included; a checkpoint without one of them is refused naming the tensor."""
    target, layers = checkpoint("bailing_hybrid")
    assert mtp_module.has_mtp(target) and specfx.speculate(target, compile=False).drafter.name == "mtp"
    expected = layers.state_dict()
    assert expected["layers.0.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # random: a bias left unread shows
    tensors = load_file(f"{target.config.name_or_path}/model.safetensors")
    assert {"model.layers.2.attention.dense.weight", "model.layers.2.mlp.gate.expert_bias"} <= set(tensors)
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in tensors
    assert all(torch.equal(v, expected[k]) for k, v in EhMtpLayers.from_checkpoint(target).state_dict().items())
    renamed = {k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")}
    for k, v in layers.state_dict().items():  # transformers' names, experts fused
        renamed["model.layers.2." + k.removeprefix("layers.0.")] = v.contiguous()
    target.config.save_pretrained(tmp_path / "hf_names")
    save_file(renamed, tmp_path / "hf_names" / "model.safetensors", metadata={"format": "pt"})
    loaded = type(target).from_pretrained(tmp_path / "hf_names", attn_implementation="sdpa")
    assert all(torch.equal(v, expected[k]) for k, v in EhMtpLayers.from_checkpoint(loaded).state_dict().items())
    del tensors["model.layers.2.attention.kv_b_proj.weight"]
    target.config.save_pretrained(tmp_path / "missing")
    save_file(tensors, tmp_path / "missing" / "model.safetensors", metadata={"format": "pt"})
    missing = type(target).from_pretrained(tmp_path / "missing", attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.2\.attention\.kv_b_proj\.weight'\]"):
        specfx.speculate(missing, draft="mtp", compile=False)


@pytest.mark.skipif(not installed("bailing_hybrid"), reason="transformers has no bailing_hybrid")
def test_bailing_layers_keep_the_tensors_the_target_keeps_in_float32(checkpoint, one_thread):
    """In bfloat16 the MTP layer's router weight and score-correction bias stay float32, as in the
    target's own layers (BailingHybrid's ``_keep_in_fp32_modules_strict``), and the layer runs."""
    target, _ = checkpoint("bailing_hybrid")
    half = type(target).from_pretrained(target.config.name_or_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    layers = EhMtpLayers.from_checkpoint(half)
    dtypes = {n: t.dtype for n, t in [*layers.named_parameters(), *layers.named_buffers()]}
    assert dtypes["layers.0.mlp.gate.weight"] == dtypes["layers.0.mlp.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["layers.0.eh_proj.weight"] == dtypes["layers.0.self_attn.o_proj.weight"] == torch.bfloat16
    assert half.model.layers[1].mlp.gate.weight.dtype == torch.float32  # what the target's own layer keeps
    spec = specfx.speculate(half, draft=specfx.MTP(layers), num_speculative_tokens=2, compile=False)
    assert spec.generate(prompt(6, vocab=VOCAB, seed=1), max_new_tokens=6, pad_token_id=0).shape == (1, 12)


def test_dedicated_mtp_embeddings_are_refused(checkpoint):
    target, _ = checkpoint("qwen3_next")
    target.config.mtp_use_dedicated_embeddings = True
    try:
        with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
            specfx.speculate(target, draft="mtp", compile=False)
    finally:
        del target.config.mtp_use_dedicated_embeddings


@pytest.mark.parametrize(
    ("arch", "match"),
    [
        ("olmo_hybrid", r"refused on model type 'olmo_hybrid': transformers ignores its checkpoints' mtp\.\* tensors "
         r"and its config declares no MTP layer count"),
        ("mamba2", r"transformers' MTP layers \(MtpModel\) are built from the target's own decoder-layer class"),
    ],
)  # fmt: skip
def test_mtp_without_a_layout_is_refused_on_stateful_targets(arch, match):
    """A stateful type without an MTP layout: its table row's reason (OLMo-Hybrid) or the generic one
    (MtpModel's layers are the target's class, which may keep state)."""
    if not installed(arch):
        pytest.skip(f"transformers has no {arch}")
    target = tiny_causal_lm(arch, **STATEFUL_TINY[arch])
    with pytest.raises(ValueError, match=match):
        specfx.speculate(target, draft="mtp", compile=False)
