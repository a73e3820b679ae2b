"""The recipe's data: the target's own answers (specfx.train.respond) to prompts of the chat
suite's kinds (specfx.train.chat_prompts), none of them a suite prompt."""

from __future__ import annotations

import json

import pytest
import torch

from specfx.demo.pair import DEMO_PAIR_DIR
from specfx.model.load import load_causal_lm, load_tokenizer
from specfx.train import chat_prompts
from specfx.train.data import load_texts
from specfx.train.respond import main, read_prompts, respond

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def pair_target():
    model = load_causal_lm(DEMO_PAIR_DIR / "target", torch.float32).eval()
    tok = load_tokenizer(DEMO_PAIR_DIR / "target")
    tok.chat_template = TEMPLATE
    return model, tok


def _prompts(n):
    return [
        {"id": f"p{i}", "category": "qa", "messages": [{"role": "user", "content": "def f" + "x" * i}]}
        for i in range(n)
    ]


def test_answers_are_the_targets_greedy_continuations_and_resume(pair_target, tmp_path):
    model, tok = pair_target
    out = tmp_path / "r.jsonl"
    prompts = _prompts(5)
    assert respond(model, tok, prompts[:3], out, max_new_tokens=6, batch_size=2, log=lambda *_: None) == 3
    assert respond(model, tok, prompts, out, max_new_tokens=6, batch_size=2, log=lambda *_: None) == 2  # only the new
    assert respond(model, tok, prompts, out, max_new_tokens=6, batch_size=2, log=lambda *_: None) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [p["id"] for p in prompts]
    for r in rows:  # each answer is what plain generate() says for that prompt alone
        p = next(p for p in prompts if p["id"] == r["id"])
        assert r["messages"][:-1] == p["messages"] and r["messages"][-1]["role"] == "assistant"
        text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        alone = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[1] :]
        assert r["messages"][-1]["content"] == tok.decode(alone, skip_special_tokens=True).strip()
    assert load_texts([out], tok)[0].startswith("<user>")  # specfx train reads it through the template


def test_padding_side_is_restored(pair_target, tmp_path):
    model, tok = pair_target
    tok.padding_side = "right"
    respond(model, tok, _prompts(2), tmp_path / "r.jsonl", max_new_tokens=2, batch_size=2, log=lambda *_: None)
    assert tok.padding_side == "right"


def test_prompt_files_are_checked(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": 1, "messages": [{"role": "assistant", "content": "x"}]}))
    with pytest.raises(ValueError, match="ending in a user turn"):
        read_prompts(f)
    f.write_text("\n".join(json.dumps(p | {"id": "same"}) for p in _prompts(2)))
    with pytest.raises(ValueError, match="unique 'id'"):
        read_prompts(f)
    with pytest.raises(SystemExit, match="chat template"):  # the demo pair's tokenizer has none
        f.write_text(json.dumps(_prompts(1)[0]))
        main(["--target", str(DEMO_PAIR_DIR / "target"), "--prompts", str(f), "--out", str(tmp_path / "o.jsonl")])


@pytest.mark.full  # the demo heads' training data (a build step, not the library)
def test_training_prompts_cover_the_suites_kinds_and_avoid_its_prompts():
    one = chat_prompts.stage_one(per_kind=6)
    assert {p["category"] for p in one} == {"code_writing", "code_editing", "math_reasoning", "passage", "multi_turn"}
    assert len({p["id"] for p in one}) == len(one) and one == chat_prompts.stage_one(per_kind=6)  # seeded
    passage = (
        "The town council met on Monday evening. It voted to open the new bridge in May, after a year of work on it. "
        * 3
    )
    answers = [
        {"id": f"passage-{i}", "category": "passage", "messages": [{"role": "assistant", "content": passage + str(i)}]}
        for i in range(4)
    ] + [
        {
            "id": "multi_turn-0",
            "category": "multi_turn",
            "messages": one[-1]["messages"] + [{"role": "assistant", "content": "a"}],
        }
    ]
    two = chat_prompts.stage_two(answers)
    kinds = {p["category"] for p in two}
    assert kinds == {"summarization", "qa", "translation", "rag", "multi_turn"}
    follow = next(p for p in two if p["category"] == "multi_turn")
    assert [m["role"] for m in follow["messages"]] == ["user", "assistant", "user"]
    chat_prompts.check_disjoint(one + two)
    suite_line = json.loads(chat_prompts.SUITE_PROMPTS.read_text().splitlines()[0])
    with pytest.raises(ValueError, match="suite prompt"):
        chat_prompts.check_disjoint([suite_line])
