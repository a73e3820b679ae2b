"""``specfx train --assistant-only-loss``: the label masks mark exactly the assistant turns (their
content and the end-of-turn token after it), travel with the windows (drawn or cached), leave
every head's loss unchanged when they mark everything and restrict it to the marked labels
otherwise, and a run trains, reports and refuses what it cannot mask."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specfx.model.load import load_tokenizer
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm
from specfx.train import build_head, main, target_pass
from specfx.train.config import TrainConfig
from specfx.train.data import Windows, label_streams, load_texts, streams
from specfx.train.evaluation import reads_target
from tests.conftest import tiered

DEMO_TARGET = Path(__file__).resolve().parents[3] / "specfx" / "demo" / "demo_pair" / "target"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
CHATS = [
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple, for one."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
     {"role": "assistant", "content": "Five, minus one... no: six minus three is three."}],
]  # fmt: skip


def chat_jsonl(path: Path, copies: int = 1) -> Path:
    """The chats and a plain text, ``copies`` times (numbered: distinct documents, split by their hash)."""
    lines = []
    for i in range(copies):
        n = f" ({i})" if copies > 1 else ""
        lines += [json.dumps({"messages": [t | {"content": t["content"] + n} for t in turns]}) for turns in CHATS]
        lines.append(json.dumps("plain text is context only" + n))
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer(str(DEMO_TARGET))
    tok.chat_template = TEMPLATE
    return tok


def test_masks_mark_each_assistant_turn_and_its_end_of_turn(tmp_path, tokenizer):
    texts = load_texts([chat_jsonl(tmp_path / "d.jsonl")], tokenizer)
    train, held, train_mask, held_mask = label_streams(tokenizer, texts, 500, 8)
    ref_train, ref_held = streams(tokenizer, texts, 500, 8)  # the same token streams as without the flag
    assert np.array_equal(train, ref_train) and np.array_equal(held, ref_held)
    ids = np.concatenate([train, held])
    mask = np.concatenate([train_mask, held_mask])
    assert ids.shape == mask.shape and set(np.unique(mask)) == {0, 1}
    eos = tokenizer.eos_token_id
    # the marked runs: each assistant content, then the end-of-turn token the template writes after it
    runs, run = [], []
    for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    assert all(r[-1] == eos for r in runs)
    marked = sorted(tokenizer.decode(r[:-1]).strip() for r in runs)
    wanted = sorted(t["content"] for turns in CHATS for t in turns if t["role"] == "assistant")
    assert marked == wanted
    assert len(runs) == 3


def test_masks_refuse_what_they_cannot_locate(tmp_path, tokenizer):
    plain = tmp_path / "p.jsonl"
    plain.write_text('"just text"\n{"text": "more"}')
    with pytest.raises(ValueError, match="no chat records with assistant turns"):
        label_streams(tokenizer, load_texts([plain], tokenizer), 500, 2)
    one_sided = tmp_path / "o.jsonl"  # one chat, the rest plain: a side of the split has no assistant tokens
    one_sided.write_text("\n".join([json.dumps({"messages": CHATS[0]})] + [json.dumps(f"text {i}") for i in range(9)]))
    with pytest.raises(ValueError, match="side of --data has no assistant tokens"):
        label_streams(tokenizer, load_texts([one_sided], tokenizer), 500, 2)
    rewriting = load_tokenizer(str(DEMO_TARGET))
    rewriting.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}"
    texts = load_texts([chat_jsonl(tmp_path / "d.jsonl")], rewriting)
    with pytest.raises(ValueError, match="does not reproduce a chat turn's content"):
        label_streams(rewriting, texts, 500, 2)


def test_masks_travel_with_the_windows_drawn_and_cached(one_thread, tmp_path):
    """The step's mask rows are the rows of the step's windows: checked with the stream itself as the mask."""
    from specfx.train.cache import FeatureCache

    runner = ModelRunner(tiny_causal_lm("llama", vocab_size=128, num_layers=2), "target")
    runner.allocate(2, 17)
    stream = np.random.default_rng(0).integers(0, 128, size=16 * 9 + 5).astype(np.int32)
    cache = FeatureCache(tmp_path / "f", runner, stream, 16, 2, 3, ("final",), target_pass)
    cache.build()
    for step in (0, 7):
        assert torch.equal(cache.mask_at(step, stream), cache.at(step)[0])
        assert torch.equal(
            Windows(stream.astype(np.uint8), 16, 2, 3).at(step), Windows(stream, 16, 2, 3).at(step) % 256
        )


SMALL = {
    "medusa": {"medusa_heads": 2},
    "pard": {"pard_k": 3, "draft_hidden": 64},
    "draft": {"draft_hidden": 64},
    "dflash": {"dflash_block": 4, "dflash_anchors": 6, "draft_layers": 1},
}


@pytest.mark.parametrize("head", tiered(["medusa", "eagle", "eagle3", "draft", "pard", "dflash"], ["eagle3", "dflash"]))
def test_every_heads_loss_counts_only_the_marked_labels(one_thread, head):
    runner = ModelRunner(tiny_causal_lm("llama", vocab_size=128, num_layers=2), "target")
    runner.allocate(2, 17)
    stream = np.random.default_rng(0).integers(0, 120, size=400).astype(np.int32)
    trainer = build_head(TrainConfig("", head, [], "", **SMALL.get(head, {})), runner, stream, None)
    ids = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, features = target_pass(runner, ids, trainer.taps) if reads_target(trainer) else (None, ())

    def loss(mask=None):
        value, acc = trainer.loss(ids, features, logits, None, mask)
        return value.item(), acc, list(getattr(trainer, "depth_acc", []))

    ones = torch.ones(2, 16, dtype=torch.long)
    plain, marked_all = loss(), loss(ones)
    assert marked_all[0] == pytest.approx(plain[0], rel=1e-5) and marked_all[1] == pytest.approx(plain[1])
    assert marked_all[2] == pytest.approx(plain[2])
    part = ones.clone()
    part[0, :10], part[1, 4:] = 0, 0  # the labels among the first ten tokens of row 0, past the fourth of row 1
    assert loss(part)[0] != pytest.approx(plain[0], rel=1e-4)
    nothing = trainer.loss(ids, features, logits, None, torch.zeros_like(ones))[0]
    assert torch.isfinite(nothing) and nothing.item() == 0.0
    nothing.backward()  # a batch without assistant labels still steps (no NaN gradients)
    if head == "draft":  # its agreement, by hand: position p's label is token p + 1
        with torch.no_grad():
            hit = trainer.module(input_ids=ids).logits.argmax(-1) == logits.argmax(-1)
        weight = torch.cat([part[:, 1:], part[:, -1:]], dim=1).bool()
        assert loss(part)[1] == pytest.approx(hit[weight].float().mean().item())
    if head == "dflash":  # block position k of the anchor a is scored where token a + k is marked
        anchors = trainer.draw_anchors(16, None, ids.device)
        with torch.no_grad():
            draft, (pos, offset) = trainer.block_logits(ids, features, anchors)
        scored = ((offset > 0) & (pos < 16)) & (part[:, pos.clamp(max=15)] > 0)
        hit = (draft.argmax(-1) == ids[:, pos.clamp(max=15)]) & scored
        assert loss(part)[1] == pytest.approx((hit.sum() / scored.sum()).item())


@pytest.mark.parametrize("head", tiered(["dflash", "eagle3", "pard"], ["dflash"]))
def test_assistant_only_run_trains_reports_and_resumes_only_as_itself(one_thread, tmp_path, head):
    target = tmp_path / "target"
    tiny_causal_lm("llama", vocab_size=4096, num_layers=2).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TARGET / name, target / name)
    data = chat_jsonl(tmp_path / "chat.jsonl", copies=40)  # no chat template: "role: content" lines
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.get(head, {}).items()]
    cached = ["--cache-features"] if head != "pard" else []
    argv = ["--target", str(target), "--head", head, "--data", str(data), "--out", str(tmp_path / "run"),
            "--batch", "2", "--seq-len", "32", "--steps", "4", "--ckpt-every", "2", "--eval-prompts", "0",
            "--heldout-permille", "300", *extra, *cached]  # fmt: skip
    assert main([*argv, "--assistant-only-loss", "--stop-after", "2"]) == 0
    history = json.loads((tmp_path / "run" / "ckpt" / "meta.json").read_text())["history"]
    assert history[0]["loss"] > 0 and "heldout_acc" in history[-1] and history[-1]["heldout_loss"] > 0
    assert main([*argv, "--resume"]) == 2  # a run of assistant-only loss is not continued as another
    assert main([*argv, "--assistant-only-loss", "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["steps"] == 4


def test_dflash_draws_each_rows_anchors_among_its_marked_positions(one_thread):
    runner = ModelRunner(tiny_causal_lm("llama", vocab_size=128, num_layers=2), "target")
    runner.allocate(2, 25)
    stream = np.random.default_rng(0).integers(0, 120, size=400).astype(np.int32)
    trainer = build_head(TrainConfig("", "dflash", [], "", **SMALL["dflash"]), runner, stream, None)
    mask = torch.zeros(2, 24, dtype=torch.long)
    mask[0, 3:15], mask[1, 10:] = 1, 1  # row 0: 12 marked, row 1: 14 marked, 6 anchors each in 0 .. 20
    anchors = trainer.draw_anchors(24, 5, "cpu", mask)
    assert anchors.shape == (2, 6) and torch.equal(anchors, anchors.sort(dim=1).values)
    assert bool(mask.gather(1, anchors).all()) and not torch.equal(anchors[0], anchors[1])
    assert torch.equal(anchors, trainer.draw_anchors(24, 5, "cpu", mask))  # a function of (seed, step)
    assert not torch.equal(anchors, trainer.draw_anchors(24, 6, "cpu", mask))
    few = torch.zeros_like(mask)
    few[:, 20:] = 1  # one markable anchor (20): the other five from the rest, all distinct
    drawn = trainer.draw_anchors(24, 5, "cpu", few)
    assert all(20 in row and len(set(row)) == 6 for row in drawn.tolist())
    # per-row anchors that are the same in both rows give the shared anchors' blocks
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(2))
    _, features = target_pass(runner, ids, trainer.taps)
    with torch.no_grad():
        shared, _ = trainer.block_logits(ids, features, anchors[0])
        per_row, _ = trainer.block_logits(ids, features, anchors[0].expand(2, -1))
    assert torch.equal(shared, per_row)


def test_eagle3_draft_vocabulary_counts_only_the_marked_tokens(one_thread):
    """SpecForge builds an EAGLE-3 head's vocabulary from the loss-masked tokens: the template's
    frequent ids (here 100..119, most of the stream) must not crowd the answers' ids out."""
    runner = ModelRunner(tiny_causal_lm("llama", vocab_size=128, num_layers=2), "target")
    runner.allocate(2, 17)
    rng = np.random.default_rng(0)
    stream = np.concatenate([rng.integers(100, 120, size=300), rng.integers(0, 10, size=100)]).astype(np.int32)
    mask = np.r_[np.zeros(300), np.ones(100)].astype(np.uint8)
    cfg = TrainConfig("", "eagle3", [], "", draft_vocab_size=10)
    assert build_head(cfg, runner, stream, None).draft_ids.tolist() != list(range(10))
    assert build_head(cfg, runner, stream, None, mask=mask).draft_ids.tolist() == list(range(10))
