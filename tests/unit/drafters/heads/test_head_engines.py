"""Train here, serve there: a head saved by specfx drafts the same in the engines users serve it
with, or its save warns, naming exactly those engines that would draft otherwise.

Each engine's loading rules (which config.json keys it reads, which tensor names it maps, what
it derives and what it drops) are restated in tests/unit/drafters/heads/engine_rules.py from its source at
a named commit; the drafting is then the plain-PyTorch reference of test_eagle.py / test_eagle3.py
run on what that engine loaded. "The same" is checked numerically (draft logits along a chain
of drafts on a 40-token context), against the reference those files check proposal by proposal
against specfx, and once end to end against specfx's own proposals in rounds.
"""

import json
import warnings

import pytest
import torch

from specfx.drafters.heads.checkpoint import HeadLayoutWarning, write_head
from specfx.drafters.heads.eagle import Eagle
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.drafters.heads.medusa import Medusa
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import prompt
from tests.unit.drafters.heads import engine_rules as rules
from tests.unit.drafters.heads.test_eagle import _check_against_reference
from tests.unit.drafters.heads.test_eagle import _Reference as Eagle1Specfx
from tests.unit.drafters.heads.test_eagle3 import _Reference as Eagle3Specfx

ALL = {"SafeAILab's EAGLE", "vLLM", "SGLang"}
THETA = 5e5  # a rotary base other than 10000: an engine that misses it drifts with the position


def _save(head, path, *args, **kwargs) -> set[str]:
    """Save ``head`` to ``path``; the engines its HeadLayoutWarning names (none: empty)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        head.save(path, *args, **kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, HeadLayoutWarning)]
    assert len(messages) <= 1
    lines = messages[0].splitlines()[1:-1] if messages else []
    return {line.strip()[2:].split(":")[0] for line in lines}


def _agree(engine, specfx, seq, steps: int = 4) -> bool:
    """Whether ``engine`` drafts what ``specfx`` drafts after ``seq``: the same draft logits
    (float32 rounding aside: 1e-4 of the largest; the same ids at -inf) at each of ``steps``
    chained draft steps, following specfx's drafts."""
    tokens = list(seq[1:])
    feats = [engine.features(seq[:-1]), specfx.features(seq[:-1])]
    for _ in range(steps):
        outs = [ref.last_output(tokens, f) for ref, f in zip((engine, specfx), feats, strict=True)]
        logits = [ref.logits(o) for ref, o in zip((engine, specfx), outs, strict=True)]
        kept = torch.isfinite(logits[1])  # EAGLE-3: -inf outside the draft vocabulary
        if not torch.equal(kept, torch.isfinite(logits[0])):
            return False
        a, b = logits[0][kept], logits[1][kept]
        if not (a - b).abs().max() <= 1e-4 * b.abs().max():  # random heads' logits grow with depth, rounding too
            return False
        tokens = tokens + [int(logits[1].argmax())]
        feats = [torch.cat([f, o]) for f, o in zip(feats, outs, strict=True)]
    return True


def _drafts_otherwise(engines, make, target, directory, seq, *args) -> set[str]:
    """The engines (of ``engines``: name -> loader) that load the head at ``directory`` and do
    not draft what specfx drafts, or do not load it at all."""
    specfx = make[1](target, directory)
    differ = set()
    for name, load in engines.items():
        try:
            same = _agree(make[0](target, load(directory, *args)), specfx, seq)
        except rules.EngineRefuses:
            same = False
        if not same:
            differ.add(name)
    return differ


SEQ = prompt(40, seed=9)[0].tolist()

# ------------------------------------------------------------------------------ EAGLE-1
EAGLE1_CASES = {
    "llama": ("llama", {}, set()),
    "SafeAILab's fc bias": ("llama", dict(fc_bias=True), {"vLLM"}),  # vLLM's fc has no bias
    "qwen2 q/k/v biases": ("qwen2", {}, {"SGLang"}),  # SGLang biases q, k, v and o together or none
    "qwen3 q/k norms": ("qwen3", {}, ALL),  # not a Llama layer
    "mistral sliding window": ("mistral", {}, ALL),  # a window of 8; the engines attend to everything
}


@pytest.mark.parametrize("case", sorted(EAGLE1_CASES))
def test_eagle1_save_warns_exactly_for_the_engines_that_draft_otherwise(case, tmp_path, one_thread):
    arch, kw, expected = EAGLE1_CASES[case]
    target = tiny_causal_lm(arch, rope_theta=THETA)
    assert _save(Eagle.random(target, seed=1, **kw), tmp_path) == expected
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_theta"] == THETA and "bias" not in config  # the base where every engine reads it
    assert _drafts_otherwise(rules.EAGLE1_ENGINES, (rules.Eagle1Engine, Eagle1Specfx), target, tmp_path, SEQ) == expected


@pytest.mark.full
def test_eagle1_a_head_trained_here_drafts_in_each_engine_what_specfx_proposes(tmp_path, one_thread):
    """End to end on a small vocabulary (drafts accepted now and then): every round's proposals
    of specfx equal those of the head as SafeAILab's, vLLM's and SGLang's rules load it."""
    target = tiny_causal_lm("llama", vocab_size=8, eos_token_id=None, rope_theta=THETA)
    assert _save(Eagle.random(target, seed=3), tmp_path) == set()  # as `specfx train` makes it: no fc bias
    for load in rules.EAGLE1_ENGINES.values():
        _check_against_reference(target, tmp_path, "chain", rules.Eagle1Engine(target, load(tmp_path)))


def test_eagle1_engines_read_the_layouts_specfx_wrote_before(tmp_path, one_thread):
    """What the save used to write, and why it was wrong there: the base only inside
    rope_parameters (SafeAILab: 10000), ``bias: true`` (vLLM and SGLang: attention biases that no
    tensor fills) and no fc.bias for a head without one (SGLang: an unfilled fc bias)."""
    target = tiny_causal_lm("llama", rope_theta=THETA)
    head = Eagle.random(target, seed=1, fc_bias=True)
    config = {k: v for k, v in head.checkpoint.config.items() if k != "rope_theta"}  # transformers 5's copy
    head.checkpoint.config = dict(config, bias=True)
    write_head(tmp_path, head.checkpoint.config, head.state_dict())
    assert rules.safeailab_eagle1(tmp_path).config["rope_theta"] == 10000.0
    for load in (rules.vllm_eagle1, rules.sglang_eagle1):
        with pytest.raises(rules.EngineRefuses, match="architectures|unloaded"):
            rules.Eagle1Engine(target, load(tmp_path))
    assert Eagle(tmp_path).has_bias  # specfx still loads it


# ------------------------------------------------------------------------------ EAGLE-3
EAGLE3_CASES = {
    # name: (target layers, Eagle3.random kwargs, engines that draft otherwise)
    "default taps of 7 layers": (7, {}, set()),
    "taps [1, 2, 5]": (7, dict(layer_ids=[1, 2, 5]), {"SafeAILab's EAGLE"}),  # SafeAILab reads no tap ids
    "narrowed heads": (7, dict(num_attention_heads=2), {"SafeAILab's EAGLE"}),  # head_dim != hidden / heads
    "the embeddings tapped": (7, dict(layer_ids=[0, 3, 6]), {"SafeAILab's EAGLE", "SGLang"}),
    "the last layer's output tapped": (7, dict(layer_ids=[2, 4, 7]), ALL),  # captured by none of them
    "default taps of 4 layers": (4, {}, ALL),  # [2, 2, 1]: each layer is captured once there
}


@pytest.mark.parametrize("case", sorted(EAGLE3_CASES))
def test_eagle3_save_warns_exactly_for_the_engines_that_draft_otherwise(case, tmp_path, one_thread):
    layers, kw, expected = EAGLE3_CASES[case]
    target = tiny_causal_lm("llama", num_layers=layers, rope_theta=THETA)
    head = Eagle3.random(target, draft_vocab_size=100, seed=2, **kw)
    assert _save(head, tmp_path) == expected
    config = json.loads((tmp_path / "config.json").read_text())
    top, nested = config["eagle_aux_hidden_state_layer_ids"], config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert nested == [k - 1 for k in top]  # vLLM reads the top, SGLang the nested key plus one: the same layers
    make = (rules.Eagle3Engine, Eagle3Specfx)
    assert _drafts_otherwise(rules.EAGLE3_ENGINES, make, target, tmp_path, SEQ, layers) == expected


def test_eagle3_norm_before_residual_is_vllms_alone(tmp_path, one_thread):
    target = tiny_causal_lm("llama", num_layers=7, rope_theta=THETA)
    head = Eagle3.random(target, draft_vocab_size=100, seed=2)
    head.head.config["norm_before_residual"] = head.head.midlayer.norm_before_residual = True
    expected = {"SafeAILab's EAGLE", "SGLang"}
    assert _save(head, tmp_path) == expected
    make = (rules.Eagle3Engine, Eagle3Specfx)
    assert _drafts_otherwise(rules.EAGLE3_ENGINES, make, target, tmp_path, SEQ, 7) == expected


def test_eagle3_reads_the_nested_taps_sglang_writes(tmp_path, one_thread):
    """A checkpoint with SGLang's/SpecForge's nested key only (ids of layer outputs) loads with
    the same taps, and specfx's save writes both keys for it."""
    target = tiny_causal_lm("llama", num_layers=7)
    with pytest.warns(HeadLayoutWarning, match="SafeAILab"):  # it reads no tap ids
        Eagle3.random(target, draft_vocab_size=100, layer_ids=[1, 2, 5], seed=2).save(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.warns(HeadLayoutWarning, match="SafeAILab"):
        Eagle3(tmp_path / "a").save(tmp_path / "b")
    again = json.loads((tmp_path / "b" / "config.json").read_text())
    assert again["eagle_aux_hidden_state_layer_ids"] == [1, 2, 5]
    assert again["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 4]


# ------------------------------------------------------------------------------ Medusa
def _specfx_logits(heads: Medusa, x):
    """What specfx's Medusa computes at hidden states ``x`` (its own tensors, as Medusa.head_logits)."""
    view = rules.MedusaLoaded(
        [[(heads.weight[i, j], None if heads.bias is None else heads.bias[i, j]) for j in range(heads.num_layers)]
         for i in range(heads.num_heads)],
        [heads.lm_head[0 if heads.shared_lm_head else i] for i in range(heads.num_heads)], {}, [],
    )  # fmt: skip
    return rules.medusa_logits(x, view, heads.num_heads)


@pytest.mark.parametrize("shared", [False, True], ids=["own LM heads", "shared LM head"])
def test_medusa_vllm_layout_is_what_vllm_loads(shared, tmp_path):
    heads = Medusa.random(32, 50, num_heads=3, num_layers=2, seed=1)
    if shared:  # vLLM's original_lm_head, blocks without biases
        heads = Medusa.from_weights(heads.weight, None, heads.lm_head[:1])
    assert _save(heads, tmp_path) == set()  # the default layout: vLLM's
    loaded = rules.vllm_medusa(tmp_path)
    assert loaded.never_loaded == []
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rules.medusa_logits(x, loaded, 3), _specfx_logits(heads, x))
    with pytest.raises(rules.EngineRefuses, match="no medusa_lm_head"):  # no engine reads both layouts
        rules.fasterdecoding_medusa(tmp_path)


def test_medusa_fasterdecoding_layout_is_what_its_loader_loads(tmp_path):
    heads = Medusa.random(32, 50, num_heads=5, num_layers=1, seed=1)
    assert _save(heads, tmp_path / "ok", layout="medusa", base_model_name_or_path="org/target") == set()
    loaded = rules.fasterdecoding_medusa(tmp_path / "ok")
    assert loaded.never_loaded == [] and loaded.config["base_model_name_or_path"] == "org/target"
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rules.medusa_logits(x, loaded, 5), _specfx_logits(heads, x))
    with pytest.raises(rules.EngineRefuses, match="does not select its MedusaConfig"):
        rules.vllm_medusa(tmp_path / "ok")
    # what its loader cannot express: 4 heads (it builds 5), two distinct blocks per head (it
    # ties them), no target named (it would load vicuna-7b)
    heads = Medusa.random(32, 50, num_heads=4, num_layers=2, seed=1)
    with pytest.warns(HeadLayoutWarning, match="builds 5 heads") as warned:
        heads.save(tmp_path / "bad", layout="medusa")
    message = str(warned[0].message)
    assert "ResBlock repeated" in message and "base_model_name_or_path" in message
    loaded = rules.fasterdecoding_medusa(tmp_path / "bad")
    assert loaded.never_loaded == ["head 4"]
    assert not torch.allclose(rules.medusa_logits(x, loaded, 4), _specfx_logits(heads, x))
