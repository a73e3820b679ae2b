"""Train here, serve there: a DFlash draft saved by specfx is what vLLM's and SGLang's DFlash
loaders read. Their loading rules (config keys, defaults, the registry entry, name mapping, what
they refuse or drop) are restated in tests/unit/drafters/heads/dflash_engine_rules.py from their
source (vLLM 0.33.0, SGLang 0.5.23; decisions 77 and 85); each test saves a draft, loads it by
those rules and checks that every saved tensor lands in a parameter of its shape, that every
parameter is filled, and that the engine reads the taps, the mask id, the block, the rotary base
and the (absent) causal mask specfx drafts with."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from specfx.drafters.heads.checkpoint import HeadLayoutWarning
from specfx.drafters.heads.dflash import DFlash
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm
from tests.unit.drafters.heads import dflash_engine_rules as rules
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
    layer inputs only: the save warns, and by their rules the target captures one state too few."""
    drafter = DFlash.random(target, block_size=BLOCK, num_layers=2, layer_ids=[1, LAYERS - 1], seed=1)
    (message,) = _save(drafter, tmp_path)
    assert "vLLM" in message and "SGLang" in message and f"last target layer ({LAYERS - 1})" in message
    with pytest.raises(EngineRefuses, match="captures 1 states"):
        rules.vllm_dflash(tmp_path, LAYERS, target.config.hidden_size)
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

