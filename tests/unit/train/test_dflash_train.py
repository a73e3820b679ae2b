"""``specfx train --head dflash``: the training forward's construction (several blocks in one
masked forward equal the drafter's block forwards, each over its own committed prefix: checked
against the independent reference of tests/unit/drafters/heads/test_dflash.py), learning a
memorisable corpus, the saved layout drafting losslessly, and an exact resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

import specfx
from specfx.model.load import load_causal_lm
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm
from specfx.train import main, target_pass
from specfx.train.dflash import DFlashTrain, block_layout
from tests.unit.drafters.heads.test_dflash import _Reference
from tests.unit.train.test_pard_train import assert_resumes_exactly, tiny_dir, toy  # noqa: F401 (fixtures)


def args(target, data, out, *extra):
    return ["--target", str(target), "--head", "dflash", "--data", str(data), "--out", str(out), "--batch", "2",
            "--seq-len", "32", "--dflash-block", "4", "--dflash-anchors", "8", "--draft-layers", "1",
            "--eval-prompt-len", "16", "--eval-new-tokens", "8", *extra]  # fmt: skip


def test_block_layout_sees_the_context_before_each_anchor_and_its_own_block():
    pos, visible, within, offset = block_layout(6, 3, torch.tensor([0, 2]))
    assert pos.tolist() == [0, 1, 2, 2, 3, 4] and offset.tolist() == [0, 1, 2] * 2
    assert visible.sum(1).tolist() == [0, 0, 0, 2, 2, 2]  # strictly before the anchor
    assert within.tolist() == [[i // 3 == j // 3 for j in range(6)] for i in range(6)]


def test_training_blocks_equal_the_reference_drafters_blocks(tmp_path, one_thread):
    target = tiny_causal_lm("llama", num_layers=4)
    runner = ModelRunner(target, "target")
    runner.allocate(2, 16)
    head = DFlashTrain(runner, None, seed=3, block_size=4, layers=2, mask_token=127, anchors=5, gamma=None)
    head.drafter.save(tmp_path)
    ids = torch.randint(3, 127, (2, 12), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([1, 4, 5, 8])
    _, features = target_pass(runner, ids, head.taps)
    with torch.no_grad():
        logits, (pos, offset) = head.block_logits(ids, features, anchors)
    reference = _Reference(target, tmp_path)
    for i, a in enumerate(anchors.tolist()):
        for b in range(2):
            expected = reference.block_logits(ids[b, : a + 1].tolist())  # context x_0 .. x_{a-1}, block at x_a
            assert torch.allclose(logits[b, 4 * i : 4 * i + 4], expected, atol=1e-4), (a, b)
    # the masks matter: a block drafted with the real tokens in place of the masks differs
    assert not torch.allclose(logits[0, 1:4], reference.block_logits(ids[0, :2].tolist())[:3], atol=1e-3)


@pytest.mark.full
def test_dflash_learns_saves_and_drafts_losslessly(one_thread, tiny_dir, toy, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    # the draft learns through the target's frozen (random) LM head: slower than PARD's own
    rc = main(args(tiny_dir, toy, out, "--steps", "300", "--ckpt-every", "150", "--lr", "1e-2", "--warmup", "5",
                   "--dflash-anchors", "16", "--eval-prompts", "1", "--eval-ks", "2", "3", "8"))  # fmt: skip
    assert rc == 0
    hist = json.loads((out / "ckpt" / "meta.json").read_text())["history"]
    assert hist[-1]["loss"] < 0.3 * hist[0]["loss"]
    depth = hist[-1]["heldout_acc_per_depth"]
    assert len(depth) == 3 and min(depth) > 0.1  # every mask of the block: chance is 1/4096
    summary = json.loads((out / "eval.json").read_text())["eval"]
    assert all(summary[k]["tau"] >= 1.0 for k in ("K=2", "K=3")) and "skipped" in summary["K=8"]  # K <= block - 1
    # z-lab's layout: config.json with block_size and dflash_config, model.safetensors without embedding / LM head
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["dflash_config"]["mask_token_id"] == 0  # the tiny target's pad id
    tensors = load_file(str(out / "head" / "model.safetensors"))
    assert "fc.weight" in tensors and not any(k.startswith(("embed", "lm_head")) for k in tensors)
    model = load_causal_lm(tiny_dir)
    spec = specfx.speculate(model, draft=f"dflash:{out / 'head'}", num_speculative_tokens=3, compile=False)
    ids = torch.tensor([[5, 17, 99, 3, 250, 8]])
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=10, do_sample=False), ref)


def test_dflash_resumes_exactly(one_thread, tiny_dir, toy, tmp_path):  # noqa: F811
    assert_resumes_exactly(lambda out, *extra: args(tiny_dir, toy, out, *extra), tmp_path)


def test_dflash_from_init_keeps_its_mask_token_and_bad_options_are_refused(one_thread, tiny_dir, toy, tmp_path):  # noqa: F811
    common = ("--steps", "2", "--eval-prompts", "0")
    assert main(args(tiny_dir, toy, tmp_path / "a", "--dflash-token", "4095", *common)) == 0
    assert main(args(tiny_dir, toy, tmp_path / "b", "--init", str(tmp_path / "a" / "head"), *common)) == 0
    cfg = json.loads((tmp_path / "b" / "head" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 4095 and cfg["block_size"] == 4
    assert main(args(tiny_dir, toy, tmp_path / "c", "--seq-len", "4", *common)) == 2  # shorter than a block
    with pytest.raises(SystemExit):
        main(args(tiny_dir, toy, tmp_path / "d", "--dflash-gamma"))


def test_dflash_taps_are_the_ones_asked_for(one_thread, tiny_dir, toy, tmp_path):  # noqa: F811
    common = ("--steps", "2", "--eval-prompts", "0")
    depth = json.loads((tiny_dir / "config.json").read_text())["num_hidden_layers"]
    assert main(args(tiny_dir, toy, tmp_path / "a", "--dflash-taps", "0", str(depth - 1), *common)) == 0
    cfg = json.loads((tmp_path / "a" / "head" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, depth - 1]
    assert load_file(str(tmp_path / "a" / "head" / "model.safetensors"))["fc.weight"].shape[1] == 2 * cfg["hidden_size"]
    assert main(args(tiny_dir, toy, tmp_path / "b", *common)) == 0  # the reference's spread for one layer
    assert json.loads((tmp_path / "b" / "head" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [
        depth // 2
    ]
    for bad in (["0", "0"], [str(depth)], ["-1"]):
        assert main(args(tiny_dir, toy, tmp_path / "c", "--dflash-taps", *bad, *common)) == 2
    init = ("--init", str(tmp_path / "a" / "head"))
    assert main(args(tiny_dir, toy, tmp_path / "d", *init, "--dflash-taps", "0", *common)) == 2


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_distilled_loss_is_the_targets_distribution_at_each_labels_predecessor(one_thread, weight):
    """``--dflash-distill w``: each scored block entry's loss is (1 - w) x cross-entropy against the data's
    token + w x cross-entropy against the target's distribution at the position before its label."""
    runner = ModelRunner(tiny_causal_lm("llama", vocab_size=128, num_layers=2), "target")
    runner.allocate(2, 17)
    ids = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(4))
    trainer = DFlashTrain(runner, None, 0, 4, 1, 127, anchors=5, gamma=None, distill=weight)
    logits, features = target_pass(runner, ids, trainer.taps)
    anchors = trainer.draw_anchors(16, None, ids.device)
    with torch.no_grad():
        loss, _ = trainer.loss(ids, features, logits)
        draft, (pos, offset) = trainer.block_logits(ids, features, anchors)
    scored = (offset > 0) & (pos < 16)
    p, q = pos[scored], draft[:, scored].float()
    hard = torch.nn.functional.cross_entropy(q.flatten(0, 1), ids[:, p].flatten())
    soft = -(logits[:, p - 1].float().softmax(-1) * q.log_softmax(-1)).sum(-1).mean()
    assert loss.item() == pytest.approx(((1 - weight) * hard + weight * soft).item(), rel=1e-5)
    assert soft.item() != pytest.approx(hard.item(), rel=1e-2)  # the two targets differ here
