"""DFlash block drafters (``specfx.DFlash``, ``draft="dflash:DIR"``) on tiny random targets.

Every draft here is written to a directory in z-lab's layout (config.json with
``dflash_config``, model.safetensors) and loaded back by path. Random drafts propose poorly, so
the tests check the machinery: greedy output equals ``model.generate()`` whatever the draft
proposes, and the proposals of every round are *exactly* those of an independent plain-PyTorch
forward of the layout (written below from the reference's definition, z-lab/dflash at commit
44947fbf71114e241c96de194f4b382b5dd330d0, reading the safetensors file; nothing from specfx)
over the committed tokens. Where transformers ships its own DFlash (>= 5.24), its candidate
generator drafts the same tokens from the same weights. Sampling losslessness is in
tests/lossless/test_lossless.py.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import specfx
from specfx.drafters.heads.dflash import DFlash
from specfx.drafters.heads.dflash_head import default_layer_ids
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import active_rounds, left_padded, prompt, tiered, unchanged
from tests.unit.drafters.heads.test_eagle3 import _rms, _rotary

ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "mistral")
LAYERS = 4
TAPS = [0, 2, 3]  # outputs of target layers 0, 2 and the last (the state after the final norm)
BLOCK = 4  # block_size: up to 3 proposals a round

_targets: dict = {}


def _target(arch: str = "llama"):
    if arch not in _targets:
        _targets[arch] = tiny_causal_lm(arch, num_layers=LAYERS)
    return _targets[arch]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """``draft_dir(arch, num_layers=2)``: the directory of a random draft for that tiny target."""
    saved = {}

    def make(arch="llama", num_layers=2):
        key = (arch, num_layers)
        if key not in saved:
            path = tmp_path_factory.mktemp(f"dflash-{arch}")
            DFlash.random(_target(arch), block_size=BLOCK, num_layers=num_layers, layer_ids=TAPS, seed=1).save(path)
            saved[key] = path
        return saved[key]

    return make


def _generate_both(target, spec, ids, mask=None, new=12):
    kw = dict(max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    if mask is not None:
        kw["attention_mask"] = mask
    return spec.generate(ids, **kw), target.generate(ids, **kw)


def _assert_greedy_equal(target, spec, ids, mask=None, new=12):
    ours, theirs = _generate_both(target, spec, ids, mask, new)
    assert torch.equal(ours, theirs)


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("arch", tiered(ARCHS, (), ci=("llama", "qwen3")))
def test_greedy_equals_generate_batch_one_and_left_padded(arch, draft_dir, one_thread):
    target = _target(arch)
    for k in (BLOCK - 1, 2):
        spec = specfx.speculate(target, draft=f"dflash:{draft_dir(arch)}", num_speculative_tokens=k, compile=False)
        assert isinstance(spec.drafter, DFlash) and spec.drafter.taps == ("layer:1", "layer:3", "final")
        _assert_greedy_equal(target, spec, prompt(5, seed=2))
        _assert_greedy_equal(target, spec, *left_padded(9, (4, 0, 6), seed=4))
        assert spec.stats.proposed > 0


@pytest.mark.full
def test_the_user_model_is_untouched_and_shared_not_copied(draft_dir, one_thread):
    target = _target("llama")
    with unchanged(target):
        spec = specfx.speculate(target, draft=DFlash(draft_dir("llama")), num_speculative_tokens=3, compile=False)
        _assert_greedy_equal(target, spec, prompt(7, seed=3))
    theirs = {p.data_ptr() for p in target.parameters()}
    assert not theirs & {p.data_ptr() for p in spec.drafter.head.parameters()}


@pytest.mark.full  # the engine's own long-lived tests (tests/api/test_long_lived.py) stand for it by default
def test_a_long_lived_generator_survives_batch_sizes_and_k(draft_dir, one_thread):
    target = _target("llama")
    spec = specfx.speculate(
        target, draft=f"dflash:{draft_dir('llama')}", num_speculative_tokens="auto", auto_k_values=(1, 3), compile=False
    )
    for ids, mask in (left_padded(8, (0, 3, 1), seed=6), (prompt(4, seed=7), None), left_padded(6, (2, 0), seed=8)):
        _assert_greedy_equal(target, spec, ids, mask, new=10)


# ----------------------------------------------------------------------------- the reference
def _read(path):
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


class _Reference:
    """z-lab's DFlash draft forward as plain PyTorch over the whole committed prefix at once
    (the reference's draft KV cache holds exactly this context): the target's hidden states
    ``hidden_states[i + 1]`` for every committed token before the pending one, concatenated,
    ``fc`` then ``hidden_norm``; the block (pending token, then mask tokens) embedded with the
    target's embedding; each layer: queries from the block, keys and values from
    ``cat[context; block]`` (k_norm on all, rotary at their positions), no mask; the final norm
    and the target's LM head at block positions 1..K, argmax."""

    def __init__(self, target, path):
        self.target, (self.cfg, self.w) = target, _read(path)

    def chain(self, seq, k):
        return self.block_logits(seq)[1 : 1 + k].argmax(-1).tolist()

    @torch.no_grad()
    def block_logits(self, seq):
        """The target's LM head on every block position ``[n, V]``, the block at the last token of ``seq``."""
        cfg, w = self.cfg, self.w
        fields, eps, theta = cfg["dflash_config"], cfg["rms_norm_eps"], cfg["rope_theta"]
        heads, kv, d, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["block_size"]
        hs = self.target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        ctx = torch.cat([hs[i + 1][0] for i in fields["target_layer_ids"]], -1) @ w["fc.weight"].T
        ctx = _rms(ctx, w["hidden_norm.weight"], eps)  # [c, H]
        c = ctx.shape[0]
        x = self.target.get_input_embeddings()(torch.tensor([seq[-1]] + [fields["mask_token_id"]] * (n - 1)))
        pos_q, pos_kv = torch.arange(c, c + n)[None], torch.arange(c + n)[None]
        for layer in range(cfg["num_hidden_layers"]):
            p = f"layers.{layer}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = _rms(
                (h @ w[p + "self_attn.q_proj.weight"].T).view(1, n, heads, d), w[p + "self_attn.q_norm.weight"], eps
            )
            both = torch.cat([ctx, h])
            key = (both @ w[p + "self_attn.k_proj.weight"].T).view(1, c + n, kv, d)
            key = _rotary(_rms(key, w[p + "self_attn.k_norm.weight"], eps), pos_kv, theta)
            val = (both @ w[p + "self_attn.v_proj.weight"].T).view(c + n, kv, d)
            q = _rotary(q, pos_q, theta)[0].transpose(0, 1)  # [heads, n, D]
            key = key[0].transpose(0, 1).repeat_interleave(heads // kv, 0)  # [heads, c + n, D]
            val = val.transpose(0, 1).repeat_interleave(heads // kv, 0)
            att = ((q @ key.transpose(-1, -2)) / d**0.5).softmax(-1) @ val  # [heads, n, D]
            x = x + att.transpose(0, 1).reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return _rms(x, w["norm.weight"], eps) @ self.target.get_output_embeddings().weight.T


def _rounds_checked(target, drafter, check, k=BLOCK - 1):
    """Generate greedily with ``drafter`` (left-padded batch) and call ``check(seq, proposals)``
    for every active row of every round; returns how many were checked."""
    rounds = []
    propose = drafter.propose

    def recording(ctx):  # on the instance: the pending positions, committed tokens and proposals
        proposals, q = propose(ctx)
        rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), proposals.clone()))
        return proposals, q

    drafter.propose = recording
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=k, compile=False)
    ids, mask = left_padded(6, (0, 3), seed=5)
    new = 12
    _assert_greedy_equal(target, spec, ids, mask, new=new)
    checked = 0
    for b, seq, proposals in active_rounds(rounds, mask.sum(dim=1).tolist(), new):
        check(seq, proposals[b].tolist())
        checked += 1
    return checked


@pytest.mark.parametrize("arch", tiered(["llama", "gemma2", "qwen3"], ["llama"]))
def test_proposals_equal_an_independent_reference_forward(arch, draft_dir, one_thread):
    target, path = _target(arch), draft_dir(arch)
    reference = _Reference(target, path)
    for k in (BLOCK - 1, 1):

        def check(seq, proposals, k=k):
            assert proposals == reference.chain(seq, k)

        assert _rounds_checked(target, DFlash(path), check, k) >= 8


# a sparse tree of depth 3 (three guesses at depth 1, two under the first): BLOCK - 1 deep
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("arch", tiered(ARCHS, ("llama",), ci=("qwen3",)))
def test_tree_nodes_are_the_reference_blocks_ranked_guesses(arch, draft_dir, one_thread):
    """Token trees (decision 103): one block forward fills the tree, the node with child ranks
    (r_1, ..., r_d) being the r_d-th most likely token of block position d in the independent
    reference forward over the committed context; greedy output equals ``generate()`` (batch 1 and
    a left-padded batch)."""
    target, path = _target(arch), draft_dir(arch)
    reference, drafter, tree = _Reference(target, path), DFlash(path), specfx.TokenTree(TREE)
    rounds, propose_tree = [], drafter.propose_tree

    def recording(ctx):
        nodes = propose_tree(ctx)
        rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), nodes.clone()))
        return nodes

    drafter.propose_tree = recording
    spec = specfx.speculate(target, draft=drafter, tree=tree, num_speculative_tokens=tree.size, compile=False)
    _assert_greedy_equal(target, spec, prompt(5, seed=2))
    rounds.clear()
    ids, mask = left_padded(6, (0, 3), seed=5)
    _assert_greedy_equal(target, spec, ids, mask)
    checked = 0
    for b, seq, nodes in active_rounds(rounds, mask.sum(dim=1).tolist(), 12):
        ranked = reference.block_logits(seq).topk(3, dim=-1).indices  # [n, 3]: each block position's guesses
        expected = [ranked[tree.depths[m], tree.ranks[m - 1]].item() for m in range(1, tree.size + 1)]
        assert nodes[b].tolist() == expected
        checked += 1
    assert checked >= 8


def test_the_reference_default_taps():
    """z-lab's ``build_target_layer_ids``: the middle layer for one draft layer, else spread."""
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16's published ids
    assert default_layer_ids(32, 1) == [16]
    assert default_layer_ids(4, 2) == [1, 1]


def _hf_assistant(path):
    """transformers' own DFlash assistant with the weights at ``path``, its names."""
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg, w = _read(path)
    fields = cfg["dflash_config"]
    config = MuseGlimmerAssistantConfig(
        **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "rms_norm_eps")},
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        layer_types=["full_attention"] * cfg["num_hidden_layers"], block_size=cfg["block_size"],
        mask_token_id=fields["mask_token_id"], target_layer_ids=fields["target_layer_ids"],
    )  # fmt: skip
    model = MuseGlimmerAssistantModel(config).eval()
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model.load_state_dict({names.get(k, k): v for k, v in w.items()}, strict=True)
    return model


def test_proposals_equal_transformers_dflash(draft_dir, tmp_path, one_thread):
    """transformers' DFlashTokenCandidateGenerator, given each round's committed prefix, drafts
    the block specfx drafted; and its assistant's checkpoint (transformers' names) loads here.
    transformers 5.17's generator (the declared minimum) asks the target for
    ``output_hidden_states=target_layer_ids`` and then indexes the returned tuple by those ids,
    which fails; 5.24's asks for ``[i + 1 ...]`` and reads ``hidden_states[i + 1]``, the reference's
    states: the comparison needs that one (the independent reference above runs on both)."""
    pytest.importorskip("transformers.models.muse_glimmer_assistant")
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    target, path = _target("llama"), draft_dir("llama")
    assistant = _hf_assistant(path)
    probe = DFlashTokenCandidateGenerator(
        assistant, target.get_input_embeddings(), target.get_output_embeddings(), GenerationConfig()
    )
    if probe.model_kwargs_overrides["output_hidden_states"] != [i + 1 for i in TAPS]:
        pytest.skip("this transformers' DFlash reads hidden_states[i], not the reference's hidden_states[i + 1]")

    def check(seq, proposals):
        gen = DFlashTokenCandidateGenerator(
            assistant, target.get_input_embeddings(), target.get_output_embeddings(),
            GenerationConfig(max_length=1000, do_sample=False),
        )  # fmt: skip
        ids = torch.tensor([seq])
        with torch.no_grad():
            out = target(ids[:, :-1], **gen.model_kwargs_overrides)
            kwargs = {"position_ids": torch.arange(len(seq))[None], "attention_mask": torch.ones_like(ids)}
            candidates, _ = gen.get_candidates(ids, kwargs, out, is_first_iteration=False, n_last_matches=0)
        assert proposals == candidates[0, len(seq) :].tolist()

    assert _rounds_checked(target, DFlash(path), check) >= 8
    # transformers' layout: config fields at the top, encoder.* names for the context projection
    cfg, _ = _read(path)
    cfg.update(cfg.pop("dflash_config"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in assistant.state_dict().items()}, tmp_path / "model.safetensors")
    reference = _Reference(target, path)
    assert _rounds_checked(target, DFlash(tmp_path), lambda seq, p: p == reference.chain(seq, BLOCK - 1)) >= 8


# ----------------------------------------------------------------------------- compiled
@pytest.mark.compiled
def test_compiled_round_is_one_graph_and_stays_warm(draft_dir, one_thread):
    target = _target("llama")
    spec = specfx.speculate(
        target, draft=f"dflash:{draft_dir('llama')}", num_speculative_tokens=3, backend="specfx_eager",
        background_compile=False,
    )  # fmt: skip
    ids, mask = left_padded(10, (0, 3), seed=7)
    _assert_greedy_equal(target, spec, ids, mask, new=16)
    assert [e.key[0] for e in spec.compile_events] == ["round"]
    round_graph = max(spec.graphs, key=lambda g: g.nodes)
    # KV writes (keys, values): the verification in 4 target layers and the context in 2 draft layers
    assert dict(round_graph.report.sites)["check_static_kv"] == 2 * (LAYERS + 2)
    ids, mask = left_padded(7, (2, 0), seed=8)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _assert_greedy_equal(target, spec, ids, mask, new=16)
    assert len(spec.compile_events) == 1  # warm: nothing recompiled


# ----------------------------------------------------------------------------- save and bad input
def test_save_round_trip_writes_z_labs_layout(draft_dir, tmp_path):
    drafter = DFlash(draft_dir("llama"))
    drafter.save(tmp_path)
    cfg, w = _read(tmp_path)
    assert cfg["block_size"] == BLOCK and cfg["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": TAPS}
    assert "fc.weight" in w and "hidden_norm.weight" in w and "layers.1.self_attn.k_norm.weight" in w
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in w)  # the target's, shared
    again = DFlash(tmp_path)
    assert all(torch.equal(v, again.head.state_dict()[k]) for k, v in drafter.head.state_dict().items())


@pytest.mark.full
def test_a_config_as_z_lab_publishes_it_loads(draft_dir, tmp_path, one_thread):
    """Keys a z-lab config.json carries besides the layout's (auto_map for its remote code, which
    specfx never runs; Qwen3's sliding-window switches, off; dtype and version fields) are read
    or ignored: the draft drafts as the plain layout does."""
    published = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "tie_word_embeddings": False, "initializer_range": 0.02,
    }  # fmt: skip
    path = _edited(draft_dir("llama"), tmp_path / "published", config=published)
    target = _target("llama")
    spec = specfx.speculate(target, draft=f"dflash:{path}", num_speculative_tokens=3, compile=False)
    plain = specfx.speculate(target, draft=f"dflash:{draft_dir('llama')}", num_speculative_tokens=3, compile=False)
    ours, theirs = _generate_both(target, spec, prompt(6, seed=11))
    assert torch.equal(ours, theirs) and torch.equal(
        ours, plain.generate(prompt(6, seed=11), max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    )
    assert spec.stats.proposed == plain.stats.proposed and spec.stats.accepted == plain.stats.accepted


def _edited(src, dst, config=None, drop=(), fields=None):
    cfg, w = _read(src)
    cfg.update(config or {})
    cfg["dflash_config"] = {**cfg["dflash_config"], **(fields or {})}
    cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items() if v is not None}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in w.items() if k not in drop}, dst / "model.safetensors")
    return dst


BAD_DRAFTS = {
    "no mask token": (dict(fields={"mask_token_id": None}), "mask_token_id"),
    "no block size": (dict(config={"block_size": None}), "block_size"),
    "sliding layers": (dict(config={"layer_types": ["sliding_attention"] * 2}), "sliding-window"),
    "dynamic rotary": (dict(config={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}), "changes with"),
    "missing tensor": (dict(drop=("layers.1.mlp.up_proj.weight",)), "missing 1 tensor"),
    "taps and fc disagree": (dict(fields={"target_layer_ids": [0, 1]}), "target_layer_ids names 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_DRAFTS))
def test_bad_checkpoints_are_clear_errors(case, draft_dir, tmp_path):
    edits, message = BAD_DRAFTS[case]
    path = _edited(draft_dir("llama"), tmp_path / "bad", **edits)
    with pytest.raises(ValueError, match=message):
        DFlash(path)


def test_pickle_only_and_missing_paths_are_clear_errors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="never loads"):
        DFlash(tmp_path)
    with pytest.raises(ValueError, match="never downloads"):
        DFlash(tmp_path / "absent")
    with pytest.raises(ValueError, match="dflash:DIR"):
        specfx.speculate(_target("llama"), draft="dflash", compile=False)


BAD_FOR_TARGET = {
    "another depth": (dict(config={"num_target_layers": 8}), "8 layers"),
    "taps past the target": (dict(fields={"target_layer_ids": [0, 2, 4]}), "must name 3 layers"),
    "another vocabulary": (dict(config={"vocab_size": 1000}), "vocabulary of 1000"),
    "mask outside the table": (dict(fields={"mask_token_id": 500}), "outside the target's embedding"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOR_TARGET))
def test_drafts_for_another_target_are_clear_errors(case, draft_dir, tmp_path):
    edits, message = BAD_FOR_TARGET[case]
    target = _target("llama")
    path = _edited(draft_dir("llama"), tmp_path / "other", **edits)
    with unchanged(target), pytest.raises(ValueError, match=message):
        specfx.speculate(target, draft=f"dflash:{path}", compile=False)


def test_a_wider_target_and_shapes_it_cannot_draft_are_refused(draft_dir):
    wide = tiny_causal_lm("llama", num_layers=LAYERS, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden size"):
        specfx.speculate(wide, draft=f"dflash:{draft_dir('llama')}", compile=False)
    with pytest.raises(ValueError, match=str(BLOCK - 1)):  # a block proposes block_size - 1 tokens at most
        specfx.speculate(
            _target("llama"), draft=f"dflash:{draft_dir('llama')}", num_speculative_tokens=BLOCK, compile=False
        )
    with pytest.raises(ValueError, match=f"at most {BLOCK - 1}"):  # a tree deeper than the block
        specfx.speculate(
            _target("llama"), draft=f"dflash:{draft_dir('llama')}", tree=specfx.TokenTree.topk(BLOCK, 1), compile=False
        )
    with pytest.raises(ValueError, match="dynamic tree"):  # EAGLE-2's trees need scores that see the path
        specfx.speculate(
            _target("llama"), draft=f"dflash:{draft_dir('llama')}", tree=specfx.TokenTree.eagle2(), compile=False
        )


@pytest.mark.full  # as EAGLE-3's (default tier), through the same binding
def test_the_draft_follows_a_target_cast_after_speculate(draft_dir, one_thread):
    target = tiny_causal_lm("llama", num_layers=LAYERS)
    spec = specfx.speculate(target, draft=f"dflash:{draft_dir('llama')}", num_speculative_tokens=3, compile=False)
    _assert_greedy_equal(target, spec, prompt(5, seed=9))
    target.to(torch.float64)
    _assert_greedy_equal(target, spec, prompt(5, seed=9))
    assert spec.drafter.head.fc.weight.dtype == torch.float64
