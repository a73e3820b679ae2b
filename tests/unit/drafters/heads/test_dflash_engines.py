"""Train here, serve there: a DFlash draft saved by specfx is what vLLM's and SGLang's DFlash
loaders read, and drafts there what it drafts in specfx. Their loading rules (config keys,
defaults, the registry entry, name mapping, what they refuse or drop) are restated in
tests/unit/drafters/heads/dflash_engine_rules.py and their block forward (context KV, the block's
layout, attention, which rows are sampled) in dflash_engine_forward.py, from their source (vLLM
0.33.0, SGLang 0.5.23; decisions 77 and 85). The loading tests save a draft, load it by those rules
and check that every saved tensor lands in a parameter of its shape, that every parameter is
filled, and that the engine reads the taps, the mask id, the block, the rotary base and the
(absent) causal mask specfx drafts with; the drafting tests run the loaded weights through the
engines' forward, step by step on a persistent KV cache, and compare the logits with specfx's."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specfx.drafters.heads.checkpoint import HeadLayoutWarning
from specfx.drafters.heads.dflash import DFlash
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm
from tests.unit.drafters.heads import dflash_engine_rules as rules
from tests.unit.drafters.heads.dflash_engine_forward import EngineDFlash
from tests.unit.drafters.heads.engine_rules import EngineRefuses

LAYERS = 6  # target layers
TAPS = [0, 2, 4]  # outputs of target layers 0, 2, 4: the last (5) is not among them
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("qwen3", num_layers=LAYERS)


def _save(drafter, path) -> list[str]:
    """Save; the messages of the HeadLayoutWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafter.save(path)
    return [str(w.message) for w in caught if issubclass(w.category, HeadLayoutWarning)]


def _read(path) -> tuple[dict, dict]:
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def _write(path, config: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return path


def _load_both(target, path):
    h = target.config.hidden_size
    return {"vLLM": rules.vllm_dflash(path, LAYERS, h), "SGLang": rules.sglang_dflash(path, LAYERS)}


def _assert_served_as_drafted(target, drafter, path, taps=TAPS):
    """Every saved tensor fills a parameter of its shape, every parameter is filled, and both
    engines read what specfx drafts with."""
    saved = load_file(str(path / "model.safetensors"))
    for engine, held in _load_both(target, path).items():
        assert held.dropped == [], f"{engine} drops {held.dropped}"
        assert held.unfilled == [], f"{engine} leaves {held.unfilled} unloaded"
        filled = sum(len(shards) for shards in held.filled.values())
        assert filled == len(saved), f"{engine}: {filled} shards filled from {len(saved)} tensors"
        assert held.read["taps"] == taps  # the outputs of these target layers, fc's order
        assert not held.read.get("before_final_norm")
        assert held.read["mask_token_id"] == drafter.head.mask_token_id
        assert held.read["causal"] == [False] * len(drafter.head.layers)  # the block sees itself whole
        assert held.read["rope_theta"] == target.config.rope_parameters["rope_theta"]
        if engine == "SGLang":
            assert held.read["block_size"] == drafter.head.block_size
        else:  # the registry's entry for the name, and the block specfx drafts by default
            assert held.read["architectures"] == ["DFlashDraftModel"]
            assert held.read["model_class"] == ("qwen3_dflash", "DFlashQwen3ForCausalLM")
            assert held.read["num_speculative_tokens"] == drafter.head.block_size - 1


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_saved_draft_is_what_vllm_and_sglang_load(target, tmp_path, num_layers):
    taps = TAPS[:num_layers] if num_layers > 1 else [2]
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=num_layers, layer_ids=taps, seed=1)
    assert _save(drafter, tmp_path) == []
    _assert_served_as_drafted(target, drafter, tmp_path, taps)
    cfg = json.loads((tmp_path / "config.json").read_text())
    # vLLM would read a top-level EAGLE-3 tap list before dflash_config's; transformers' copies
    # at the top level would be a second source
    assert not {"eagle_aux_hidden_state_layer_ids", "target_layer_ids", "mask_token_id", "is_causal"} & set(cfg)
    assert cfg["num_target_layers"] == LAYERS and cfg["model_type"] == "qwen3"


def test_attention_biases_are_served_too(target, tmp_path):
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS[:2], seed=2)
    head = drafter.head
    config = dict(head.config, attention_bias=True)  # a draft whose attention projections carry biases
    tensors = dict(head.tensors())
    for i, layer in enumerate(head.layers):
        for p in ("q", "k", "v", "o"):
            rows = getattr(layer.self_attn, f"{p}_proj").weight.shape[0]
            tensors[f"layers.{i}.self_attn.{p}_proj.bias"] = torch.randn(rows)
    biased = DFlash(_write(tmp_path / "src", config, tensors))
    assert _save(biased, tmp_path / "out") == []
    _assert_served_as_drafted(target, biased, tmp_path / "out", TAPS[:2])
    held = rules.vllm_dflash(tmp_path / "out", LAYERS, target.config.hidden_size)
    assert set(held.filled["layers.1.self_attn.qkv_proj.bias"]) == {"q", "k", "v"}


def test_the_engines_refuse_what_they_cannot_serve(target, tmp_path):
    """The restated loaders are not vacuous: a tensor under another name, and a prefix, fail."""
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS[:2], seed=1)
    drafter.save(tmp_path / "ok")
    cfg, w = _read(tmp_path / "ok")
    for case, tensors in {
        "renamed": {k.replace("hidden_norm", "context_norm"): v for k, v in w.items()},
        "prefixed": {f"model.model.{k}": v for k, v in w.items()},
    }.items():
        _write(tmp_path / case, cfg, tensors)
        with pytest.raises(EngineRefuses, match="no parameter"):
            rules.vllm_dflash(tmp_path / case, LAYERS, target.config.hidden_size)
        held = rules.sglang_dflash(tmp_path / case, LAYERS)
        assert held.dropped and held.unfilled  # SGLang drops them without a word: garbage weights


def test_vllm_resolves_the_saved_names_only(target, tmp_path):
    """vLLM 0.33.0 serves the draft as DFlash only with ``method="dflash"`` (or "dflash" in the
    path), finds the drafter class by the architecture EAGLEConfig keeps, and needs
    ``num_speculative_tokens`` unless the config's ``n_predict`` gives it: without the saved
    names the restated rules refuse, so the checks above can fail."""
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS[:2], seed=1)
    drafter.save(tmp_path / "ok")
    cfg, w = _read(tmp_path / "ok")
    h = target.config.hidden_size
    named = _write(tmp_path / "Qwen3-DFlash-b4", cfg, w)  # "dflash" in the path: the method is found
    assert rules.vllm_dflash(named, LAYERS, h, method=None).read["model_class"][0] == "qwen3_dflash"
    plain = _write(tmp_path / "plain", cfg, w)
    with pytest.raises(EngineRefuses, match="draft_model"):  # no method, no "dflash" in the path
        rules.vllm_dflash(plain, LAYERS, h, method=None)
    assert rules.vllm_dflash(plain, LAYERS, h, num_speculative_tokens=2).read["num_speculative_tokens"] == 2
    for case, change, match in [
        ("qwen3-name", dict(architectures=["Qwen3ForCausalLM"]), "no registered DFlash architecture"),
        ("no-n-predict", dict(n_predict=None), "num_speculative_tokens was not provided"),
    ]:
        bad = {k: v for k, v in {**cfg, **change}.items() if v is not None}
        with pytest.raises(EngineRefuses, match=match):
            rules.vllm_dflash(_write(tmp_path / case, bad, w), LAYERS, h)


def test_a_tap_on_the_last_layer_warns_naming_both_engines(target, tmp_path):
    """The reference reads the last layer's output after the final norm; the engines capture
    layer inputs (vLLM 0.33.0 also the last layer's output, before the final norm): the save
    warns, and by their rules vLLM feeds fc another state and SGLang captures one too few."""
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=[1, LAYERS - 1], seed=1)
    (message,) = _save(drafter, tmp_path)
    assert "vLLM" in message and "SGLang" in message and f"last target layer ({LAYERS - 1})" in message
    held = rules.vllm_dflash(tmp_path, LAYERS, target.config.hidden_size)
    assert held.read["taps"] == [1, LAYERS - 1] and held.read["before_final_norm"] == [LAYERS - 1]
    with pytest.raises(EngineRefuses, match="captures 1 states"):
        rules.sglang_dflash(tmp_path, LAYERS)


def test_taps_left_to_the_default_are_written_out(target, tmp_path):
    """A draft whose config names no taps (z-lab's default applies at bind) is saved with them
    named: the engines resolve no such default (vLLM sizes fc by the draft's depth)."""
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=2, seed=1)  # the reference's spread
    drafter.save(tmp_path / "named")
    cfg, w = _read(tmp_path / "named")
    default = cfg["dflash_config"].pop("target_layer_ids")
    _write(tmp_path / "unnamed", cfg, w)
    with pytest.raises(EngineRefuses):  # unnamed: vLLM's fc would take num_hidden_layers states of no known layers
        rules.vllm_dflash(tmp_path / "unnamed", LAYERS, target.config.hidden_size)
    unbound = DFlash(tmp_path / "unnamed")
    assert _save(unbound, tmp_path / "resaved") == []  # num_target_layers is known: the default is written
    assert _read(tmp_path / "resaved")[0]["dflash_config"]["target_layer_ids"] == default
    _assert_served_as_drafted(target, unbound, tmp_path / "resaved", default)
    cfg.pop("num_target_layers")  # nor the depth: nothing to resolve until bound, and the save says so
    _write(tmp_path / "unnamed", cfg, w)
    (message,) = _save(DFlash(tmp_path / "unnamed"), tmp_path / "unknown")
    assert "no target_layer_ids" in message
    bound = DFlash(tmp_path / "unnamed")
    bound.bind(ModelRunner(target, "target"))
    assert _save(bound, tmp_path / "bound") == []
    _assert_served_as_drafted(target, bound, tmp_path / "bound", default)


def test_transformers_layout_is_saved_as_z_labs(target, tmp_path):
    """A draft in transformers' assistant layout (top-level fields, ``encoder.*`` names, its own
    class and model type) is saved in the layout both engines read."""
    DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS[:2], seed=3).save(tmp_path / "z")
    cfg, w = _read(tmp_path / "z")
    cfg.update(cfg.pop("dflash_config"), architectures=["MuseGlimmerAssistantModel"])
    cfg.update(
        model_type="muse_glimmer_assistant",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
    )
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    drafter = DFlash(_write(tmp_path / "hf", cfg, {names.get(k, k): v for k, v in w.items()}))
    assert _save(drafter, tmp_path / "out") == []
    _assert_served_as_drafted(target, drafter, tmp_path / "out", TAPS[:2])
    again = DFlash(tmp_path / "out")  # and specfx reads it back, the same weights
    assert all(torch.equal(v, again.head.state_dict()[k]) for k, v in drafter.head.state_dict().items())


# ----------------------------------------------------------------------------- drafting numerics
# Accepted proposals per round (K = BLOCK - 1 = 3): context steps of 1 to 4 tokens, so blocks'
# mask KV sits at positions that later hold accepted tokens, and the engines must have rewritten it
SCHEDULE = (0, 3, 1, 2, 0, 3, 1)
PROMPT = 6
SEQ = torch.randint(3, 128, (PROMPT + sum(n + 1 for n in SCHEDULE) + 1,), generator=torch.Generator().manual_seed(9))


def _steps():
    """(first context position, pending position L) of every round: the prompt, then each round's
    pending token and its accepted proposals."""
    out, start, pending = [(0, PROMPT)], PROMPT, PROMPT
    for accepted in SCHEDULE:
        start, pending = pending, pending + accepted + 1
        out.append((start, pending))
    return out


@torch.no_grad()
def _specfx_blocks(target, path, k: int) -> list[tuple[torch.Tensor, list[int]]]:
    """specfx's DFlash drafter itself (``observe``, ``propose``) bound to ``target``, fed the
    target's tapped states of the committed tokens of each step and the pending token: per round
    the draft logits ``[k, V]`` (the LM head's output inside ``propose``) and the proposals."""
    drafter, runner = DFlash(path), ModelRunner(target, "target")
    runner.allocate(1, 64)
    drafter.bind(runner)
    drafter.allocate(1, 64)
    hidden = target(SEQ[None], output_hidden_states=True).hidden_states
    features = [hidden[int(tap.removeprefix("layer:"))] for tap in drafter.taps]  # taps "layer:i": hidden[i]
    seen = []
    hook = target.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(o))
    out = []
    try:
        for start, pending in _steps():
            pos = torch.arange(start, pending)[None]
            drafter.observe(None, tuple(f[:, start:pending] for f in features), pos, pos)
            seen.clear()
            proposals, _ = drafter.propose(SimpleNamespace(lengths=torch.tensor([pending]), tokens=SEQ[None], k=k))
            (logits,) = seen
            out.append((logits[0], proposals[0].tolist()))
    finally:
        hook.remove()
    return out


@torch.no_grad()
def _engine_blocks(engine: str, target, path, **serve) -> list[torch.Tensor]:
    """The same steps as the engine runs them: its loaded weights, the target layers it captures,
    context rows then the block on one persistent KV cache; per round the sampled rows' logits."""
    h = target.config.hidden_size
    held = (
        rules.vllm_dflash(path, LAYERS, h, **serve) if engine == "vLLM" else rules.sglang_dflash(path, LAYERS, **serve)
    )
    rows = held.read["num_speculative_tokens"] + 1 if engine == "vLLM" else held.read["block_size"]
    hidden = target(SEQ[None], output_hidden_states=True).hidden_states
    taps = torch.cat([hidden[i + 1][0] for i in held.read["taps"]], dim=-1)  # the input of layer i + 1
    config = json.loads((path / "config.json").read_text())
    run = EngineDFlash(
        engine, held, config, target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    out = []
    for start, pending in _steps():
        run.store_context(taps[start:pending], torch.arange(start, pending))
        out.append(run.block_logits(int(SEQ[pending]), pending - 1, rows, held.read["mask_token_id"]))
    return out


def _worst(ours, theirs, k: int) -> float:
    return max((mine - got[:k]).abs().max().item() for (mine, _), got in zip(ours, theirs, strict=True))


def _biased(target, path):
    """A saved draft whose attention projections carry biases (the engines stack them too)."""
    head = DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS, seed=5).head
    tensors = dict(head.tensors())
    g = torch.Generator().manual_seed(6)
    for i, layer in enumerate(head.layers):
        for p in ("q", "k", "v", "o"):
            rows = getattr(layer.self_attn, f"{p}_proj").weight.shape[0]
            tensors[f"layers.{i}.self_attn.{p}_proj.bias"] = torch.randn(rows, generator=g) * 0.1
    DFlash(_write(path / "src", dict(head.config, attention_bias=True), tensors)).save(path)
    return path


@pytest.mark.parametrize("engine", ["vLLM", "SGLang"])
@pytest.mark.parametrize("biases", [False, True])
def test_the_engines_draft_what_specfx_drafts(target, tmp_path, engine, biases, one_thread):
    """Served as saved (vLLM's block from ``n_predict``, SGLang's from ``block_size``), every
    round's draft logits equal specfx's and so do the greedy proposals."""
    if biases:
        _biased(target, tmp_path)
    else:
        DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS, seed=4).save(tmp_path)
    ours, theirs = _specfx_blocks(target, tmp_path, BLOCK - 1), _engine_blocks(engine, target, tmp_path)
    assert _worst(ours, theirs, BLOCK - 1) < 1e-5
    assert [got[: BLOCK - 1].argmax(-1).tolist() for got in theirs] == [p for _, p in ours]


def test_a_causal_block_drafts_otherwise_and_the_comparison_sees_it(target, tmp_path, one_thread):
    """Negative control: the same weights with ``is_causal: true`` in the config (which both
    engines honour and specfx never writes) give other logits, by far more than the tolerance."""
    DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS, seed=4).save(tmp_path / "ok")
    cfg, w = _read(tmp_path / "ok")
    causal = _write(tmp_path / "causal", dict(cfg, is_causal=True), w)
    ours = _specfx_blocks(target, tmp_path / "ok", BLOCK - 1)
    for engine in ("vLLM", "SGLang"):
        assert _worst(ours, _engine_blocks(engine, target, causal), BLOCK - 1) > 1e-3


def test_vllm_with_fewer_speculative_tokens_drafts_a_shorter_block(target, tmp_path, one_thread):
    """vLLM's block is 1 + num_speculative_tokens rows whatever the draft was trained on; specfx
    (as the reference) always runs the whole block and keeps the first K proposals. Attention
    inside the block goes both ways, so at K < block_size - 1 vLLM's drafts differ; SGLang's block
    is the config's block_size and equals specfx's at any K."""
    DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=TAPS, seed=4).save(tmp_path)
    ours = _specfx_blocks(target, tmp_path, 1)
    assert _worst(ours, _engine_blocks("vLLM", target, tmp_path, num_speculative_tokens=1), 1) > 1e-3
    assert _worst(ours, _engine_blocks("SGLang", target, tmp_path), 1) < 1e-5


def test_a_target_that_scales_its_embeddings_drafts_otherwise_and_the_save_says_so(tmp_path, one_thread):
    """transformers' Gemma embedding module multiplies by sqrt(hidden_size); specfx and the
    reference embed the block through it, the engines with the raw table: other drafts, and a
    save bound to such a target warns naming both engines."""
    gemma = tiny_causal_lm("gemma2", num_layers=LAYERS)
    drafter = DFlash.random(gemma, block_size=BLOCK, num_layers=2, layer_ids=TAPS, seed=4)
    drafter.bind(ModelRunner(gemma, "target"))
    (message,) = _save(drafter, tmp_path)
    assert "vLLM" in message and "SGLang" in message and "input-embedding module scales" in message
    ours = _specfx_blocks(gemma, tmp_path, BLOCK - 1)
    assert _worst(ours, _engine_blocks("vLLM", gemma, tmp_path), BLOCK - 1) > 1e-3
