"""The EAGLE-3 head shipped for SmolLM2-135M-Instruct (``specfx/demo/smollm2_eagle3``, its
MODEL_CARD.md): small bfloat16 safetensors in the public EAGLE-3 layout, and, on the real model
(from the user's cache; skipped, saying why, only where it cannot be made), greedy output equal to
HF ``generate()`` with more than one token per round on held-out prompts (the chat suite's)."""

import json

import pytest
import torch
from safetensors import safe_open

import specfx
from specfx.bench.tasks.suite_prompts import load_suite, make_batches
from specfx.demo import chat, smollm2
from specfx.demo.smollm2 import SMOLLM2_EAGLE3_DIR
from tests.unit.demo.test_chat_demo import smollm2_directory  # noqa: F401 (a fixture: the converted model)

HEAD = SMOLLM2_EAGLE3_DIR


def test_shipped_files_are_small_bfloat16_safetensors_in_the_eagle3_layout():
    names = sorted(p.name for p in HEAD.iterdir())
    assert names == ["MODEL_CARD.md", "config.json", "model.safetensors"]
    assert (HEAD / "model.safetensors").stat().st_size <= 20_000_000  # the budget
    config = json.loads((HEAD / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == 49152 and config["hidden_size"] == 576 and config["draft_vocab_size"] == 8192
    with safe_open(HEAD / "model.safetensors", "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    assert {d for n, d in dtypes.items() if n not in ("d2t", "t2d")} == {"BF16"}
    assert "embed_tokens.weight" not in dtypes  # the target's embeddings are shared, as the layout has it
    assert chat.head_kind(HEAD) == "eagle3" and chat.resolve_draft("eagle3") == f"eagle3:{HEAD}"


@pytest.fixture(scope="module")
def smollm2_model(request):
    request.getfixturevalue("smollm2_directory")  # converted, or skipped saying why it cannot be made here
    return smollm2.load_smollm2()


def test_head_on_the_real_model_is_exact_and_trained(smollm2_model, one_thread):
    model, tok = smollm2_model
    suite = load_suite()
    prompts = [suite["code_editing"][0], suite["qa"][0]]  # held out: no training prompt repeats a suite prompt
    (enc,) = make_batches(tok, prompts, 2, "cpu")  # a left-padded batch
    gen = dict(max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**enc, **gen)
    spec = specfx.speculate(model, draft=specfx.Eagle3(HEAD), num_speculative_tokens=4, compile=False)
    out = spec.generate(**enc, **gen)
    assert torch.equal(out, ref)
    assert spec.stats.tokens_per_round > 1.5, spec.stats  # trained (an untrained head gives about 1)


@pytest.mark.full  # the demo command itself: test_chat_demo.py; this head's exactness: the test above
@pytest.mark.exhaustive  # (a minute to load and run: pytest --full, not CI)
def test_demo_runs_the_shipped_head(smollm2_model, one_thread, capsys):
    from specfx import cli

    argv = ["demo", "--draft", "eagle3", "--no-compile", "--max-new-tokens", "8", "--num-prompts", "1"]
    assert cli.main(argv + ["--repeats", "1", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "greedy output identical to HF generate(): yes" in out and "eagle3" in out
