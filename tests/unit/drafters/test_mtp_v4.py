"""DeepSeek-V4's MTP layer (``ArchSpec.mtp_layout = "deepseek_v4"``; decision 98): transformers drops the
checkpoint's ``mtp.*`` tensors and specfx builds the layer from the target's own V4 classes.

The reference is a restatement of DeepSeek's V4 inference code (``MTPBlock`` in the checkpoint's
``inference/model.py``) and of SGLang's loader (``DeepseekV4ModelNextN``, ``deepseek_v4_nextn.py``), written
here from their facts (no code copied): depth -1 is the target's last decoder layer's output streams
``[T, hc, H]`` *before* its ``hc_head``; ``x = e_proj(enorm(embed(token)))[:, None] + h_proj(hnorm(streams))``
(each stream normed and projected on its own); one V4 block with sliding-window attention only (SGLang
builds it with compress ratio 0) and top-k routing; the LM head (the target's) reads
``norm(hc_head(out))`` with the layer's own ``hc_head_fn/base/scale`` (``rsqrt(mean(x^2) + eps)`` over the
flattened streams, ``sigmoid(mixes * scale + base) + hc_eps`` as the streams' weights); the next depth reads
the output streams.

The V4 block itself is transformers' own layer, loaded by transformers' own ``deepseek_v4`` conversion
(the MTP tensors renamed to a layer past the target's and read by ``from_pretrained``), run over the whole
window from scratch: what specfx adds (names, the streams' plumbing, cache, mask, rope, chaining, the
tapped streams of the target) is checked against the restatement. Breaking specfx's layer (the hidden
state read after the target's ``hc_head``, ``hnorm`` left out, the layer's own ``hc_head`` replaced by
the target's) fails the numerics test.
"""

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import specfx
from specfx.drafters.mtp_v4 import V4MtpLayers
from specfx.model.architectures import installed
from specfx.testing.mtp import fc_mtp_checkpoint
from tests.conftest import active_rounds, prompt

pytestmark = pytest.mark.skipif(not installed("deepseek_v4"), reason="transformers has no deepseek_v4")
VOCAB = 8  # random MTP layers then agree with the target often enough for rounds that accept some
OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")  # the MTP depth's own tensors

_checkpoints = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(m=1)``: ``(a tiny V4 target loaded from its checkpoint, the random MTP layers saved in it)``."""

    def get(m: int = 1):
        if m not in _checkpoints:
            _checkpoints[m] = fc_mtp_checkpoint("deepseek_v4", m, tmp_path_factory.mktemp(f"v4_{m}"), vocab=VOCAB)
        return _checkpoints[m]

    return get


class _Restated:
    """DeepSeek's V4 MTP over the raw checkpoint tensors (see the module docstring)."""

    def __init__(self, target, tmp_path):
        path = target.config.name_or_path
        with safe_open(f"{path}/model.safetensors", framework="pt") as f:
            self.w = {k: f.get_tensor(k) for k in f.keys()}
        self.c = target.config
        self.head = self.w["head.weight"]
        self.embed = self.w["model.embed_tokens.weight"]
        self.layers = self._blocks(tmp_path)

    def _blocks(self, tmp_path):
        """transformers' V4 block of each MTP depth: the depth's block tensors saved as layers past the
        target's (sliding-window attention, top-k routing) and loaded by ``from_pretrained``'s own conversion."""
        n, m = self.c.num_hidden_layers, self.c.num_nextn_predict_layers
        config = copy.deepcopy(self.c)
        config.num_hidden_layers = n + m
        config.layer_types = [*self.c.layer_types, *["sliding_attention"] * m]
        config.mlp_layer_types = [*self.c.mlp_layer_types, *["moe"] * m]
        config.save_pretrained(tmp_path)
        tensors = {k: v for k, v in self.w.items() if not k.startswith("mtp.")}
        for k, v in self.w.items():
            if k.startswith("mtp.") and not k.split(".", 2)[2].startswith(OWN):
                _, i, rest = k.split(".", 2)
                tensors[f"model.layers.{n + int(i)}.{rest}"] = v
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", output_loading_info=True
        )
        assert not any(info.values()), info  # every block tensor read, none left over
        self.rotary = model.model.rotary_emb
        return [model.model.layers[n + i].eval() for i in range(m)]

    def norm(self, x, name):  # RMSNorm: x / rms(x) * w, in float32
        x32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)
        return (x32 * self.w[name].float()).to(x.dtype)

    def hc_head(self, x, p):  # x [T, hc, H] -> [T, H]
        flat = x.flatten(-2).float()
        mixes = (flat @ self.w[p + "hc_head_fn"].float().T) * torch.rsqrt(
            flat.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps
        )
        pre = torch.sigmoid(mixes * self.w[p + "hc_head_scale"].float() + self.w[p + "hc_head_base"].float())
        return ((pre + self.c.hc_eps).unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)

    @torch.no_grad()
    def step(self, tokens, streams, positions, depth: int = 0):
        """``tokens [T]`` at ``positions [T]``, ``streams [T, hc, H]`` at each position - 1, one causal window
        -> (output streams ``[T, hc, H]``, logits ``[T, V]``)."""
        p = f"mtp.{depth}."
        e = self.norm(self.embed[tokens], p + "enorm.weight") @ self.w[p + "e_proj.weight"].T
        h = self.norm(streams, p + "hnorm.weight") @ self.w[p + "h_proj.weight"].T
        x = (e.unsqueeze(1) + h).unsqueeze(0)  # [1, T, hc, H]
        t, window = x.shape[1], self.c.sliding_window
        q, k = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
        visible = (k <= q) & (q - k < window)
        mask = torch.zeros(1, 1, t, t).masked_fill(~visible, float("-inf"))
        pos = positions.unsqueeze(0)
        rope = {kind: self.rotary(x[:, :, 0], position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        out = self.layers[depth](x, position_embeddings=rope, position_ids=pos, attention_mask=mask)[0]
        return out, self.norm(self.hc_head(out, p), p + "norm.weight") @ self.head.T

    @staticmethod
    def target_streams(target, ids):
        """The target's last decoder layer's output ``[n, hc, H]`` (before its hc_head) over ``ids [1, n]``."""
        got = []
        hook = target.model.layers[-1].register_forward_hook(lambda mod, args, out: got.append(out))
        try:
            with torch.no_grad():
                target(ids)
        finally:
            hook.remove()
        return got[0][0]

    def greedy_chain(self, target, committed: list[int], k: int) -> list[int]:
        """The k drafts after ``committed`` (the last one pending): the target's streams over the prefix, then
        one restated step per draft over the whole window from scratch (the one depth chained on its output)."""
        streams = self.target_streams(target, torch.tensor([committed[:-1]]))  # at 0..n-1
        tokens, drafts = list(committed[1:]), []
        for _ in range(k):
            out, logits = self.step(torch.tensor(tokens), streams, torch.arange(1, len(tokens) + 1))
            drafts.append(int(logits[-1].argmax()))
            tokens.append(drafts[-1])
            streams = torch.cat([streams, out[-1:]])
        return drafts


@pytest.fixture(scope="module")
def restated(checkpoint, tmp_path_factory):
    return _Restated(checkpoint()[0], tmp_path_factory.mktemp("v4_restated"))


# ----------------------------------------------------------------- (a) numerics
def test_mtp_layer_equals_restated_deepseek_forward(checkpoint, restated, one_thread):
    """specfx's MTP depth (loaded by ``draft="mtp"`` from the checkpoint, run through the drafter's own
    cache, mask and rope, the streams flattened) gives the restated forward's logits and output streams
    over a window longer than the sliding window."""
    target, _ = checkpoint()
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=2, compile=False)
    drafter = spec.drafter
    assert type(drafter.mtp) is V4MtpLayers and drafter.taps == ("last",)
    drafter.allocate(1, 64)
    t, hc, h = 11, target.config.hc_mult, target.config.hidden_size
    assert t > target.config.sliding_window and hc > 1
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (t,), generator=g)
    streams = torch.randn(t, hc, h, generator=g)
    pos = torch.arange(1, t + 1)
    with torch.no_grad():
        out = drafter._layer(
            0, tokens.unsqueeze(0), streams.flatten(1).unsqueeze(0), pos.unsqueeze(0), pos.unsqueeze(0)
        )
        got = drafter._logits(out, 0)[0]
    expected_out, expected = restated.step(tokens, streams, pos)
    scale = expected.abs().max()
    assert scale > 1.0  # the logits are far from zero: a wrong layer could not hide in the tolerance
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    streams_scale = expected_out.abs().max()
    torch.testing.assert_close(out[0], expected_out.flatten(1), rtol=0, atol=1e-5 * streams_scale)


def test_the_target_tap_is_its_last_layers_streams(checkpoint, one_thread):
    """Depth -1 reads the target's last decoder layer's output streams (before its hc_head), from the
    tapped verify forward: equal to a hook on that layer in HF's own forward."""
    target, _ = checkpoint()
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=2, compile=False)
    runner, ids = spec.target_runner, prompt(7, vocab=VOCAB, seed=4)
    runner.allocate(1, 32)
    pos = torch.arange(7).unsqueeze(0)
    with torch.no_grad():
        _, (streams,) = runner.forward(ids, pos, pos, taps=spec.drafter.taps)
    expected = _Restated.target_streams(target, ids)
    assert streams.shape == (1, 7, target.config.hc_mult, target.config.hidden_size)
    torch.testing.assert_close(streams[0], expected, rtol=0, atol=1e-5 * expected.abs().max())


# ----------------------------------------------------------------- (b) greedy equality and the rounds' proposals
class _Recording(specfx.MTP):
    def propose(self, ctx):
        proposals, q = super().propose(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals, q


@pytest.mark.parametrize("batch", [1, pytest.param(2, marks=pytest.mark.full)])
def test_proposals_equal_the_restated_chain_and_greedy_equals_generate(batch, checkpoint, restated, one_thread):
    """Batch 1 and a batch of two equal-length prompts (V4 refuses left-padded ones, decision 97), K = 3 past
    the one MTP depth (chained on its own output streams): every round's proposals, per row, equal the
    restated chain run from scratch over the row's committed tokens, and the output equals ``generate()``,
    with rounds that accept some proposals and reject most."""
    target, _ = checkpoint()
    drafter = _Recording()
    drafter.rounds = []
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=3, compile=False)
    new, checked = 12, 0
    ids = prompt(9, vocab=VOCAB, seed=1) if batch == 1 else prompt(7, batch=2, vocab=VOCAB, seed=2)
    expected = target.generate(ids, max_new_tokens=new, do_sample=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=new, do_sample=False), expected)
    for b, committed, proposals in active_rounds(drafter.rounds, [ids.shape[1]] * ids.shape[0], new):
        assert proposals[b].tolist() == restated.greedy_chain(target, committed, 3), (b, committed)
        checked += 1
    assert checked >= 5
    assert 0 < spec.stats.accepted < spec.stats.proposed


@pytest.mark.full  # the default tier: the numerics, the tap, the eager rounds' proposals
def test_compiled_round_is_one_graph_and_equals_generate(checkpoint, one_thread):
    """``backend="specfx_eager"``: the MTP depth's draft steps and the target's tapped verify forward (its
    streams) in one round graph per batch bucket, the output equal to ``generate()``."""
    target, _ = checkpoint()
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=3, backend="specfx_eager")
    for ids in (prompt(9, vocab=VOCAB, seed=1), prompt(7, batch=2, vocab=VOCAB, seed=2)):
        expected = target.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=12, do_sample=False), expected)
    assert len(spec.graphs) == 2
    assert 0 < spec.stats.accepted < spec.stats.proposed


@pytest.mark.full
def test_two_mtp_depths_greedy_equals_generate(checkpoint, one_thread):
    """Two depths (DeepSeek ships one): depth i runs layer i with its own hc_head and norm, then the last chains."""
    target, _ = checkpoint(2)
    spec = specfx.speculate(target, draft="mtp", num_speculative_tokens=4, compile=False)
    assert spec.drafter.num_layers == 2
    ids = prompt(10, batch=2, vocab=VOCAB, seed=5)
    expected = target.generate(ids, max_new_tokens=14, do_sample=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=14, do_sample=False), expected)
    assert spec.stats.accepted > 0


# ----------------------------------------------------------------- loading and refusals
def test_the_layers_load_from_deepseeks_names_and_are_the_default_drafter(checkpoint, one_thread):
    target, layers = checkpoint()
    assert specfx.speculate(target, compile=False).drafter.name == "mtp"
    names = set(load_file(f"{target.config.name_or_path}/model.safetensors"))
    assert {
        "mtp.0.e_proj.weight",
        "mtp.0.attn.wkv.weight",
        "mtp.0.ffn.experts.3.w2.weight",
        "mtp.0.hc_head_fn",
    } <= names
    loaded = V4MtpLayers.from_checkpoint(target).state_dict()
    assert loaded.keys() == layers.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in layers.state_dict().items())


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _fp8(w, block=(16, 16)):
    """``w`` quantized as DeepSeek ships its FP8 matrices (``float8_e4m3fn``, one float32 factor per block), and
    the matrix the pair stands for (computed here by repeating the factors, not by specfx's blocks)."""
    g = (w.shape[0] // block[0], w.shape[1] // block[1])
    scale = torch.full(g, 2.0**-3) * torch.arange(1, g[0] * g[1] + 1).view(g).remainder(3).add(1)  # 1x, 2x, 3x
    big = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    q = (w / big).to(torch.float8_e4m3fn)
    return q, scale, q.float() * big


def _fp4(w, block=32):
    """``w``'s shape as DeepSeek's FP4 experts (E2M1 nibbles, two per ``int8`` byte, the low one first; one
    ``uint8`` exponent per 1 x 32 block): random nibbles and exponents, and the matrix they stand for."""
    rows, cols = w.shape
    g = torch.Generator().manual_seed(rows * cols)
    nibbles = torch.randint(0, 16, (rows, cols), generator=g)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    exponents = torch.randint(123, 127, (rows, cols // block), generator=g).to(torch.uint8)
    factors = (exponents.float() - 127).exp2().repeat_interleave(block, 1)
    return packed, exponents, E2M1[nibbles] * factors


def test_quantized_mtp_tensors_are_dequantized_on_loading(checkpoint, tmp_path, one_thread):
    """DeepSeek's FP8 matrices (``mtp.0.attn.wq_a``, ``e_proj``, ...) and FP4 experts, each with its ``.scale``:
    the layers read equal the matrices the pairs stand for, and ``draft="mtp"`` on that checkpoint equals
    ``generate()``."""
    target, _ = checkpoint()
    tensors = load_file(f"{target.config.name_or_path}/model.safetensors")
    expected = {}
    for name in [n for n in tensors if n.startswith("mtp.0.") and n.endswith(".weight") and tensors[n].dim() == 2]:
        w = tensors[name]
        if ".experts." in name and w.shape[1] % 32 == 0:
            q, s, expected[name] = _fp4(w)
        elif w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0 and ".gate." not in name:
            q, s, expected[name] = _fp8(w)
        else:
            continue
        tensors[name], tensors[name[: -len("weight")] + "scale"] = q, s
    assert any(".experts." in n for n in expected) and "mtp.0.e_proj.weight" in expected
    target.config.save_pretrained(tmp_path)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = type(target).from_pretrained(tmp_path, attn_implementation="eager")
    layers = V4MtpLayers.from_checkpoint(model)
    loaded = {layers.checkpoint_name(k): v for k, v in _per_expert(layers.state_dict()).items()}
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    spec = specfx.speculate(model, draft="mtp", num_speculative_tokens=3, compile=False)
    ids = prompt(9, vocab=VOCAB, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=6), model.generate(ids, max_new_tokens=6, do_sample=False))


def _per_expert(state):
    from specfx.drafters.mtp_fc import _unfold_experts

    return _unfold_experts(state)


def test_incomplete_or_untileable_mtp_tensors_are_a_clear_error(checkpoint, tmp_path, one_thread):
    target, _ = checkpoint()
    tensors = load_file(f"{target.config.name_or_path}/model.safetensors")
    for name, edit, match in (
        ("missing", {"mtp.0.h_proj.weight": None}, r"missing \['mtp.0.h_proj.weight'\]"),
        ("untileable", {"mtp.0.e_proj.scale": torch.ones(3, 5)}, r"scale 'mtp.0.e_proj.scale' of shape \[3, 5\]"),
        ("orphan", {"mtp.0.h_proj.weight": None, "mtp.0.h_proj.scale": torch.ones(1, 1)}, r"not 'mtp.0.h_proj.weight'"),
    ):
        edited = {k: v for k, v in {**tensors, **edit}.items() if v is not None}
        target.config.save_pretrained(tmp_path / name)
        save_file(edited, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        model = type(target).from_pretrained(tmp_path / name, attn_implementation="eager")
        with pytest.raises(ValueError, match=match):
            specfx.speculate(model, draft="mtp", num_speculative_tokens=2, compile=False)
