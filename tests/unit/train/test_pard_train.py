"""``specfx train --head pard``: the training forward's construction (one 4-D-masked forward
equals the separate causal forwards the drafter runs), COD's chains, learning a memorisable
corpus, the saved layout drafting losslessly, and an exact resume."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import specfx
from specfx.model.load import load_causal_lm
from specfx.testing.tiny import tiny_causal_lm
from specfx.train import main
from specfx.train.pard import cod_keep, default_mask_token, pard_layout
from tests.unit.drafters.pard_engine_layout import parallel_drafting_token_id

DEMO_TARGET = Path(__file__).resolve().parents[3] / "specfx" / "demo" / "demo_pair" / "target"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama with the demo pair's tokenizer (vocabulary 4096), saved."""
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_causal_lm("llama", vocab_size=4096, num_layers=2).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TARGET / name, d / name)
    return d


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """One sentence, repeated: a corpus a tiny draft memorises in a few dozen steps."""
    d = tmp_path_factory.mktemp("toy")
    (d / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return d


def args(target, data, out, *extra):
    return ["--target", str(target), "--head", "pard", "--data", str(data), "--out", str(out), "--batch", "2",
            "--seq-len", "32", "--pard-k", "4", "--draft-hidden", "64", "--eval-prompt-len", "16",
            "--eval-new-tokens", "8", *extra]  # fmt: skip


@pytest.mark.parametrize("ratio", [1.0, 0.7])
def test_masked_forward_equals_the_drafters_causal_forwards(one_thread, ratio):
    model = tiny_causal_lm("llama", vocab_size=64, num_layers=2)
    t, k, mask = 12, 4, 63
    ids = torch.randint(0, 60, (2, t), generator=torch.Generator().manual_seed(0))
    kept = cod_keep(t, k, ratio, 0.2, np.random.default_rng(1))
    tokens, pos, att, labels, depth = pard_layout(ids, k, mask, kept)
    assert att.shape == (2, 1, tokens.shape[1], tokens.shape[1]) and att.dtype == torch.float32
    with torch.no_grad():
        out = model(input_ids=tokens, position_ids=pos, attention_mask=att).logits
        plain = model(input_ids=tokens, position_ids=pos).logits  # the mask ignored: not the same
        anchors = pos[0] - depth
        for e in range(tokens.shape[1]):
            a, j = int(anchors[e]), int(depth[e])
            # what Pard feeds: the real tokens up to a, then j masks at consecutive positions
            seq = torch.cat([ids[:, : a + 1], torch.full((2, j), mask)], 1)
            assert torch.allclose(out[:, e], model(input_ids=seq).logits[:, -1], atol=1e-4), (a, j)
            assert (tokens[:, e] == (mask if j else ids[:, a])).all()
            target = a + 1 + j
            assert (labels[:, e] == (ids[:, target] if target < t else -100)).all()
    assert not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_distilled_loss_is_the_targets_distribution_where_each_entry_predicts(one_thread, weight):
    """``--pard-distill w``: entry (t, j), the real tokens up to t then j masks, is scored against
    the target's distribution at position t + j (its prediction of x_{t+1+j} from the real tokens),
    mixed with the hard label's cross-entropy; recomputed here entry by entry from separate causal
    forwards of the draft and one plain forward of the target."""
    from specfx.model.runner import ModelRunner
    from specfx.train.pard import PardTrain

    target = tiny_causal_lm("llama", vocab_size=64, num_layers=2, seed=1)
    head = PardTrain(ModelRunner(target, role="target"), None, 0, 1, 64, None, 4, 63, 0.7, 0.2, distill=weight)
    assert head.reads_target
    t, mask = 12, 63
    ids = torch.randint(0, 60, (2, t), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher = target(input_ids=ids).logits  # [B, T, V]
        loss, _ = head.loss(ids, (), teacher, step=3)
        kept = cod_keep(t, 4, 0.7, 0.2, np.random.default_rng([0, 3, 7]))  # the draw loss() makes at step 3
        soft, hard = [], []
        for a, j in [(a, 0) for a in range(t)] + [(int(a), j + 1) for j, km in enumerate(kept) for a in km]:
            if a + 1 + j >= t:
                continue
            seq = torch.cat([ids[:, : a + 1], torch.full((2, j), mask)], 1)
            logp = head.module(input_ids=seq).logits[:, -1].float().log_softmax(-1)  # [B, V]
            soft.append(-(teacher[:, a + j].float().softmax(-1) * logp).sum(-1))
            hard.append(-logp.gather(1, ids[:, a + 1 + j, None]).squeeze(1))
        expected = (1 - weight) * torch.cat(hard).mean() + weight * torch.cat(soft).mean()
    assert torch.allclose(loss, expected, atol=1e-4), (loss, expected)


def test_layout_is_built_on_the_windows_device():
    # meta stands in for CUDA: a CPU tensor mixed into the layout's torch.where fails on either
    ids = torch.zeros((2, 12), dtype=torch.long, device="meta")
    kept = cod_keep(12, 4, 0.7, 0.2, np.random.default_rng(1))
    assert {t.device.type for t in pard_layout(ids, 4, 63, kept)} == {"meta"}


def test_cod_keeps_chains_and_shrinks_with_depth():
    kept = cod_keep(100, 8, 0.7, 0.2, np.random.default_rng(0))
    # int(100 * max(0.7**j, 0.2)); 0.7**2 * 100 is just under 49 in floats, as in the reference
    assert [len(a) for a in kept] == [70, 48, 34, 24, 20, 20, 20]
    for shallow, deep in zip(kept, kept[1:], strict=False):
        assert set(deep) <= set(shallow)  # every kept mask has its shallower masks
    full = cod_keep(100, 8, 1.0, 0.2, None)
    assert [len(a) for a in full] == [100 - 1 - j for j in range(1, 8)]  # targets inside the window


def test_default_mask_token_is_an_existing_unused_id():
    from transformers import LlamaConfig

    class Tok:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    c = LlamaConfig(vocab_size=200, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    assert default_mask_token(c, Tok(150)) == 150  # padded embedding: first id past the tokenizer
    assert default_mask_token(c, Tok(200)) == 199  # else the last id
    c.pad_token_id = 0
    assert default_mask_token(c, Tok(200)) == 0
    c.pad_token_id = 2  # pad == EOS occurs in data: not used
    assert default_mask_token(c, Tok(200)) == 199


def test_pard_learns_saves_and_drafts_losslessly(one_thread, tiny_dir, toy, tmp_path):
    out = tmp_path / "run"
    rc = main(args(tiny_dir, toy, out, "--steps", "60", "--ckpt-every", "30", "--lr", "3e-3", "--warmup", "5",
                   "--eval-prompts", "1", "--eval-ks", "2", "4"))  # fmt: skip
    assert rc == 0
    hist = json.loads((out / "ckpt" / "meta.json").read_text())["history"]
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    depth = hist[-1]["heldout_acc_per_depth"]
    assert len(depth) == 4 and depth[1] > 0.5  # mask depth 1: chance is 1/4096
    summary = json.loads((out / "eval.json").read_text())
    assert set(summary["eval"]) == {"K=2", "K=4"} and all(r["tau"] >= 1.0 for r in summary["eval"].values())
    # the reference's layout: config.json with pard_token / spd_type, model.safetensors
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["spd_type"] == "pard" and cfg["pard_token"] == 0  # the tiny target's pad id
    assert (out / "head" / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    drafter = specfx.Pard(AutoModelForCausalLM.from_pretrained(out / "head"))
    model = load_causal_lm(tiny_dir)
    spec = specfx.speculate(model, draft=drafter, num_speculative_tokens=3, compile=False)
    ids = torch.tensor([[5, 17, 99, 3, 250, 8]])
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=10, do_sample=False), ref)
    # the random target never agrees with the corpus; against the trained model itself as the
    # target, proposals past depth 0 (the masks') are accepted too (a smoke check: which token
    # each mask is trained on is pinned by the construction test above)
    from transformers import AutoTokenizer

    own = AutoModelForCausalLM.from_pretrained(out / "head").eval()
    prompt = torch.tensor([AutoTokenizer.from_pretrained(tiny_dir)("the quick brown fox jumps over the").input_ids])
    spec = specfx.speculate(own, draft=drafter, num_speculative_tokens=4, compile=False)
    got = spec.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, own.generate(prompt, max_new_tokens=16, do_sample=False))
    assert spec.cumulative_stats.per_position_rate[1] > 0 and spec.cumulative_stats.tokens_per_round > 2


def assert_resumes_exactly(make_args, tmp_path):
    """A run stopped at step 2 and resumed ends where an uninterrupted one does: the same losses
    step by step, the same parameters and optimizer state. ``make_args(out, *extra)``."""
    common = ("--eval-prompts", "0", "--ckpt-every", "2", "--warmup", "1", "--steps", "4")
    assert main(make_args(tmp_path / "a", *common)) == 0
    assert main(make_args(tmp_path / "b", "--stop-after", "2", *common)) == 0
    assert json.loads((tmp_path / "b" / "ckpt" / "meta.json").read_text())["step"] == 2
    assert main(make_args(tmp_path / "b", *common)) == 2  # no --resume: refused
    assert main(make_args(tmp_path / "b", "--resume", *common)) == 0
    ha = json.loads((tmp_path / "a" / "ckpt" / "meta.json").read_text())
    hb = json.loads((tmp_path / "b" / "ckpt" / "meta.json").read_text())
    assert hb["step"] == 4 and ha["history"] == hb["history"]  # same losses step by step
    a = load_file(str(tmp_path / "a" / "ckpt" / "state.safetensors"))
    b = load_file(str(tmp_path / "b" / "ckpt" / "state.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("distill", [(), ("--pard-distill", "0.5")], ids=["hard", "distilled"])
def test_pard_resumes_exactly(one_thread, tiny_dir, toy, tmp_path, distill):
    assert_resumes_exactly(lambda out, *extra: args(tiny_dir, toy, out, *distill, *extra), tmp_path)


def test_pard_from_init_keeps_the_family_and_the_mask_token(one_thread, tiny_dir, toy, tmp_path, capsys):
    out = tmp_path / "init"
    common = ("--steps", "2", "--eval-prompts", "0", "--init", str(tiny_dir))
    assert main(args(tiny_dir, toy, out, "--pard-token", "4095", *common)) == 0
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["pard_token"] == 4095 and cfg["num_hidden_layers"] == 2  # the --init model, not a fresh one
    # a PARD draft as --init keeps its own mask id; an id the data uses is warned about
    assert main(args(tiny_dir, toy, tmp_path / "again", *common[:-1], str(out / "head"))) == 0
    assert json.loads((tmp_path / "again" / "head" / "config.json").read_text())["pard_token"] == 4095
    from transformers import AutoTokenizer

    used = AutoTokenizer.from_pretrained(tiny_dir)("the quick").input_ids[0]
    capsys.readouterr()
    assert main(args(tiny_dir, toy, tmp_path / "used", "--pard-token", str(used), *common)) == 0
    assert "occurs" in capsys.readouterr().out


@pytest.mark.parametrize("conflicting", [False, True])
def test_a_saved_pard_draft_is_what_vllm_serves(one_thread, tmp_path, conflicting):
    """vLLM runs PARD as ``method="draft_model"`` with ``parallel_drafting`` (vllm/config/
    speculative.py @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443, and in vLLM 0.33.0): the draft is an
    ordinary causal LM in transformers' layout, of the target's vocabulary size
    (``verify_equal_vocab_size_if_draft_model``), whose config names the mask id vLLM reads
    (tests/unit/drafters/pard_engine_layout.py; what it drafts there: test_pard_engines.py)."""
    from transformers import AutoModelForCausalLM

    from specfx.model.runner import ModelRunner
    from specfx.train.pard import PardTrain

    target = tiny_causal_lm("llama", vocab_size=256, num_layers=2)
    runner = ModelRunner(target, "target")
    head = PardTrain(runner, None, 0, 1, 64, None, 4, 200, 0.7, 0.2)
    if conflicting:  # a config that names a mask id of its own (vLLM reads it before pard_token)
        head.module.config.mask_token_id = 5
    path = head.save(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert parallel_drafting_token_id(cfg) == 200 and cfg["pard_token"] == 200 and cfg["spd_type"] == "pard"
    assert cfg["vocab_size"] == target.config.vocab_size and cfg["architectures"] == ["LlamaForCausalLM"]
    # the rotary base where readers on transformers 4 look, equal to transformers 5's
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == target.config.rope_parameters["rope_theta"]
    # transformers' names, nothing else: the architecture's own loader takes every tensor
    saved = load_file(str(path / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path)
    expected = {n for n, _ in model.named_parameters()}  # a tied LM head is listed (and saved) once
    assert set(saved) == expected and all(saved[n].shape == p.shape for n, p in model.named_parameters())
    assert specfx.Pard(model).mask_token_id == 200
