"""``specfx bench suite``: the prompt suite, its rendering and batching, the timing loop's token
checks, the report's arithmetic on synthetic timings, and a smoke run on SmolLM2-135M-Instruct.

The tests that need the real tokenizer or model skip, with the reason, when SmolLM2 has not been
converted on this machine (``specfx.demo.smollm2.smollm2_dir(fetch=False)``; nothing is fetched).
"""

import json

import pytest
import torch

from specfx.bench.harness import BASELINE
from specfx.bench.tasks import suite
from specfx.bench.tasks.suite_report import (
    category_summary,
    config_table,
    markdown_report,
    specfx_differences,
    summarise,
    target_checks,
)

CHAT_END = "<|im_end|>"


@pytest.fixture(scope="module")
def smollm2_directory():
    from specfx.demo.smollm2 import smollm2_dir

    try:
        return smollm2_dir(fetch=False)
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not on this machine ({e})")


@pytest.fixture(scope="module")
def tokenizer(smollm2_directory):
    from specfx.model.load import load_tokenizer

    return load_tokenizer(smollm2_directory)


# ----------------------------------------------------------------------------- the suite file
def test_the_suite_has_every_category_with_eight_prompts():
    prompts = suite.load_suite()
    assert list(prompts) == list(suite.CATEGORIES)
    for category, items in prompts.items():
        assert len(items) >= 8, category
        assert all(p["category"] == category and p["messages"][-1]["role"] == "user" for p in items)
    ids = [p["id"] for items in prompts.values() for p in items]
    assert len(ids) == len(set(ids))
    texts = [m["content"] for items in prompts.values() for p in items for m in p["messages"]]
    assert len(texts) == len(set(texts))  # no prompt is a copy of another


def test_multi_turn_prompts_carry_a_previous_assistant_turn():
    for p in suite.load_suite()["multi_turn"]:
        assert [m["role"] for m in p["messages"]] == ["user", "assistant", "user"], p["id"]


def test_grounded_categories_hold_their_passage():
    prompts = suite.load_suite()
    for category in ("summarization", "qa", "rag", "code_editing"):
        for p in prompts[category]:
            assert len(p["messages"][-1]["content"]) > 150, p["id"]  # an instruction plus its material
    assert all("[1] " in p["messages"][0]["content"] and "[3] " in p["messages"][0]["content"] for p in prompts["rag"])


def test_the_suite_file_is_package_data():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(suite.__file__).parents[3] / "pyproject.toml").read_text())
    assert "prompts/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["specfx.bench"]


@pytest.mark.parametrize(
    "line, what",
    [
        ("{not json", "JSONDecodeError"),
        ('{"id": "x", "category": "qa"}', "KeyError"),
        ('{"id": "x", "category": "qa", "messages": [{"role": "assistant", "content": "hi"}]}', "ending with a user"),
    ],
)
def test_a_malformed_line_is_refused_with_its_number(tmp_path, line, what):
    path = tmp_path / "suite.jsonl"
    good = {"id": "a", "category": "qa", "messages": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"suite.jsonl:2: .*{what}"):
        suite.load_suite(path)


# ----------------------------------------------------------------------------- rendering and batches
def test_every_prompt_renders_through_the_chat_template(tokenizer):
    for items in suite.load_suite().values():
        for p in items:
            text = suite.render(tokenizer, p["messages"])
            assert text.endswith("<|im_start|>assistant\n"), p["id"]
            for m in p["messages"]:
                assert f"<|im_start|>{m['role']}\n{m['content']}{CHAT_END}" in text, p["id"]


def test_a_category_is_left_padded_into_one_batch(tokenizer):
    prompts = suite.load_suite()["rag"][:8]
    (batch,) = suite.make_batches(tokenizer, prompts, 8, "cpu")
    ids, mask = batch["input_ids"], batch["attention_mask"]  # [8, S]
    assert ids.shape == mask.shape and ids.shape[0] == 8
    assert torch.equal(mask, mask.sort(dim=1).values)  # zeros, then ones: padding on the left
    assert (ids[mask == 0] == tokenizer.pad_token_id).all()
    lengths = mask.sum(1)
    assert lengths.max() == ids.shape[1] and lengths.min() < ids.shape[1]  # the prompts differ in length
    for row, p in enumerate(prompts):
        alone = tokenizer(suite.render(tokenizer, p["messages"]), return_tensors="pt").input_ids[0]
        assert torch.equal(ids[row, ids.shape[1] - len(alone) :], alone), p["id"]


def test_the_last_batch_is_filled_by_cycling(tokenizer):
    prompts = suite.load_suite()["translation"][:5]
    batches = suite.make_batches(tokenizer, prompts, 3, "cpu")
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3]
    first = suite.make_batches(tokenizer, prompts[:1], 1, "cpu")[0]["input_ids"][0]
    last = batches[1]["input_ids"][2]  # prompts 3, 4, then 0 again
    assert torch.equal(last[len(last) - len(first) :], first)


def test_new_tokens_are_counted_up_to_and_including_eos():
    prompt = torch.full((3, 4), 7)
    new = torch.tensor([[5, 6, 2, 2, 2], [5, 5, 5, 5, 5], [2, 2, 2, 2, 2]])  # EOS 2; HF pads with it
    out = torch.cat([prompt, new], 1)
    assert suite.count_new_tokens(out, 4, {2}) == 3 + 5 + 1
    assert suite.count_new_tokens(out, 4, set()) == 15
    assert suite.count_new_tokens(out, 4, {9, 5}) == 1 + 1 + 5


# ----------------------------------------------------------------------------- arguments
def test_quick_fills_only_what_is_not_given():
    args = suite.parse_args(["--quick", "--batch-sizes", "1,8"])
    assert (args.num_prompts, args.max_new_tokens, args.repeats, args.no_compile) == (1, 8, 1, True)
    assert args.mode_list == ["greedy"] and args.batch_values == [1, 8]
    full = suite.parse_args([])
    assert (full.num_prompts, full.max_new_tokens, full.repeats, full.no_compile) == (None, 128, 3, False)
    assert full.mode_list == ["greedy", "sample"] and full.batch_values == [1, 8]
    assert full.category_list == list(suite.CATEGORIES) and full.drafter_list == ["default"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--categories", "poetry"], "--categories takes a comma-separated subset of multi_turn"),
        (["--modes", "beam"], "--modes takes greedy, sample"),
        (["--batch-sizes", "one"], "--batch-sizes takes comma-separated integers"),
        (["--max-new-tokens", "0"], "must be >= 1"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--drafters", "default,bogus"], "--drafters takes 'default' and/or drafter names (dflash, eagle"),
        (["--drafters", "default@0"], "a fixed K after @, e.g. pard:DIR@8"),
        (["--drafters", "prompt_lookup@auto"], "a fixed K after @"),
    ],
)
def test_bad_arguments_say_what_to_pass(argv, message, capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_drafter_at_k_runs_with_that_fixed_k_and_without_at_k_auto():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64, pad_token_id=0
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    args = suite.parse_args(["--drafters", "default,prompt_lookup@3,default@5", "--no-compile"])
    methods, specs = suite.build_methods(args, model, 2, "greedy")
    assert set(specs) == {"specfx", "specfx[prompt_lookup@3]", "specfx[default@5]"}
    assert specs["specfx"].auto_k is not None
    assert (specs["specfx[prompt_lookup@3]"].auto_k, specs["specfx[prompt_lookup@3]"].k) == (None, 3)
    assert (specs["specfx[default@5]"].auto_k, specs["specfx[default@5]"].k) == (None, 5)
    assert "specfx[default@5]" in methods


def test_help_is_plain_text(capsys):
    from specfx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "suite", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage: specfx bench suite" in out and "--quick" in out
    for markup in ("``", ":mod:", ":func:", ":class:"):
        assert markup not in out


# ----------------------------------------------------------------------------- the timing loop
def fake_methods(wrong_column: int | None):
    """hf_dynamic emits 4 tokens then EOS (2); "specfx" the same, or one token off at ``wrong_column``."""

    def reference(b):
        rows = b["input_ids"].shape[0]
        return torch.cat([b["input_ids"], torch.tensor([[5, 6, 7, 8, 2, 2]]).expand(rows, 6)], 1)

    def specfx_like(b):
        out = reference(b).clone()
        if wrong_column is not None:
            out[0, b["input_ids"].shape[1] + wrong_column] = 9
        return out

    return {BASELINE: reference, "specfx": specfx_like}


@pytest.mark.parametrize("wrong_column", [None, 2])
def test_the_timing_loop_counts_tokens_and_checks_greedy_equality(wrong_column):
    args = suite.parse_args(["--repeats", "2"])
    ids = torch.ones(2, 3, dtype=torch.long)
    batches = {"qa": [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}] * 2}
    results = suite.bench_config(args, fake_methods(wrong_column), {}, batches, "greedy", {2}, lambda: None)
    for name in (BASELINE, "specfx"):
        res = results[name]["categories"]["qa"]
        assert res["tokens"] == [2 * 2 * 5] * 2 and len(res["times_s"]) == 2  # 2 batches x 2 rows x (4 + EOS)
        assert res["tokens_per_s"] > 0
    res = results["specfx"]["categories"]["qa"]
    assert res["same_tokens_as_hf_dynamic"] is (wrong_column is None)
    assert res["first_mismatch"] == (None if wrong_column is None else 3 + wrong_column)
    runs = {"greedy": {"1": {"methods": results}}}
    assert specfx_differences(runs) == ([] if wrong_column is None else ["greedy batch 1 specfx on qa"])


def test_a_method_that_fails_is_reported_not_fatal():
    args = suite.parse_args(["--repeats", "1"])
    methods = fake_methods(None) | {"hf_prompt_lookup": lambda b: suite._raise(ValueError("batch > 1"))}
    ids = torch.ones(1, 3, dtype=torch.long)
    batches = {"qa": [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]}
    results = suite.bench_config(args, methods, {}, batches, "sample", {2}, lambda: None)
    assert results["hf_prompt_lookup"]["status"] == "error" and "batch > 1" in results["hf_prompt_lookup"]["reason"]
    assert "same_tokens_as_hf_dynamic" not in results["specfx"]["categories"]["qa"]  # sampling: not compared


# ----------------------------------------------------------------------------- the report's arithmetic
def synthetic(speeds: dict[str, dict[str, float]]) -> dict:
    """Results as the timing loop leaves them, from method -> category -> tokens/s."""
    return {
        name: {"status": "ok", "categories": {c: {"tokens_per_s": s, "tau": 2.0} for c, s in by_cat.items()}}
        for name, by_cat in speeds.items()
    }


def test_ratios_pick_hf_s_faster_speculative_option_per_category():
    results = synthetic(
        {
            BASELINE: {"qa": 10.0, "rag": 20.0},
            "hf_prompt_lookup": {"qa": 12.5, "rag": 16.0},
            "hf_early_exit": {"qa": 5.0, "rag": 25.0},
            "specfx": {"qa": 25.0, "rag": 30.0},
        }
    )
    qa, rag = (category_summary(results, "specfx", c) for c in ("qa", "rag"))
    assert (qa["vs_hf_dynamic"], qa["vs_hf_prompt_lookup"], qa["vs_hf_best"], qa["hf_best"]) == (
        2.5,
        2.0,
        2.0,
        "hf_prompt_lookup",
    )
    assert (rag["vs_hf_dynamic"], rag["vs_hf_prompt_lookup"], rag["vs_hf_best"], rag["hf_best"]) == (
        1.5,
        1.875,
        1.2,
        "hf_early_exit",
    )
    summary = summarise(results, batch=1)["specfx"]
    assert summary["average"]["vs_hf_dynamic"] == pytest.approx(2.0)
    assert summary["average"]["vs_hf_best"] == pytest.approx(1.6)
    assert [t["passed"] for t in summary["targets"]] == [True, True, True]  # 2.0 >= 1.5; 1.5 >= 1.0; 1.2 >= 1.2
    assert summary["targets"][2]["where"] == "rag"


def test_targets_fail_on_one_slow_category():
    per = {
        "qa": {"vs_hf_dynamic": 2.6, "vs_hf_best": 1.3},
        "math_reasoning": {"vs_hf_dynamic": 0.9, "vs_hf_best": 1.19},
    }
    checks = target_checks(per, {"vs_hf_dynamic": 1.75, "vs_hf_best": 1.245})
    assert [(c["passed"], c["where"]) for c in checks] == [
        (True, None),
        (False, "math_reasoning"),
        (False, "math_reasoning"),
    ]
    assert checks[1]["value"] == 0.9 and checks[2]["value"] == 1.19


def test_at_batch_8_hf_s_speculation_is_na_and_no_target_is_judged():
    results = synthetic({BASELINE: {"qa": 40.0}, "specfx": {"qa": 48.0}})
    results["specfx[lookahead]"] = {"status": "error", "reason": "ValueError: no", "categories": {}}
    summary = summarise(results, batch=8)
    assert list(summary) == ["specfx"]  # a method that did not run has no ratios
    row = summary["specfx"]["categories"]["qa"]
    assert row["vs_hf_dynamic"] == pytest.approx(1.2) and row["vs_hf_best"] is None and row["hf_best"] is None
    assert summary["specfx"]["average"]["vs_hf_best"] is None and summary["specfx"]["targets"] == []
    # at batch 1 without HF's speculative peers the third target cannot be judged: n/a, not PASS
    assert [t["passed"] for t in summarise(results, batch=1)["specfx"]["targets"]] == [False, True, None]


def test_the_markdown_report_prints_numbers_targets_and_what_did_not_run():
    results = synthetic(
        {BASELINE: {"qa": 10.0}, "hf_prompt_lookup": {"qa": 11.0}, "hf_early_exit": {"qa": 4.0}, "specfx": {"qa": 12.0}}
    )
    results["specfx"]["categories"]["qa"]["same_tokens_as_hf_dynamic"] = True
    runs = {"greedy": {"1": dict(methods=results, summary=summarise(results, 1))}}
    b8 = synthetic({BASELINE: {"qa": 30.0}, "specfx": {"qa": 27.0}})
    b8["specfx[lookahead]"] = {"status": "error", "reason": "ValueError: not here", "categories": {}}
    runs["greedy"]["8"] = dict(methods=b8, summary=summarise(b8, 8))
    args = suite.parse_args([])
    meta = dict(
        model="m",
        command="specfx bench suite",
        device="cpu",
        machine=dict(threads=1, cpu="cpu"),
        versions=dict(torch="t", transformers="x"),
        load_avg=dict(start=(0.5, 0, 0), end=(1.5, 0, 0)),
        wall_s=3.0,
    )
    text = markdown_report(runs, args, meta)
    assert "| qa | 10.0 | 11.0 | 4.0 | 12.0 | 1.20x | 1.09x | 1.09x (HF prompt lookup) | 2.00 | yes |" in text
    assert "average vs HF generate() >= 1.5x: 1.20x -> **FAIL**" in text
    assert "every category vs HF generate() >= 1.0x: 1.20x (lowest: qa) -> **PASS**" in text
    assert "| qa | 30.0 | n/a | n/a | 27.0 | 0.90x | n/a | n/a |" in text
    assert "| 2.00 | yes | n/a |" in text  # no seconds in these synthetic results: no time ratio
    assert "specfx[lookahead]: not run (ValueError: not here)" in text


def test_the_time_ratio_compares_seconds_where_sampled_token_counts_differ():
    """Sampling at batch 8: specfx emitted half HF's tokens (its rows happened to stop sooner) in
    less time: tokens/s says 0.55x, the time ratio says specfx finished the prompts sooner."""
    results = synthetic({BASELINE: {"qa": 828 / 19.4}, "specfx": {"qa": 410 / 17.4}})
    results[BASELINE]["categories"]["qa"]["median_s"] = 19.4
    results["specfx"]["categories"]["qa"]["median_s"] = 17.4
    summary = summarise(results, batch=8)["specfx"]
    row = summary["categories"]["qa"]
    assert row["vs_hf_dynamic"] == pytest.approx(0.553, abs=1e-3)
    assert row["time_vs_hf_dynamic"] == pytest.approx(19.4 / 17.4)
    assert summary["average"]["time_vs_hf_dynamic"] == pytest.approx(19.4 / 17.4)
    assert "| 1.11x |" in "\n".join(config_table(results, summarise(results, 8), "specfx"))


def test_without_matplotlib_the_plot_is_skipped_with_a_hint(monkeypatch, tmp_path, capsys):
    import sys

    from specfx.bench.tasks.suite_report import suite_plot

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    results = synthetic({BASELINE: {"qa": 10.0}, "specfx": {"qa": 12.0}})
    assert suite_plot(tmp_path / "suite.png", {"greedy": {"1": {"summary": summarise(results, 1)}}}) is None
    assert not (tmp_path / "suite.png").exists() and 'pip install "specfx[plot]"' in capsys.readouterr().err


def test_the_plot_draws_every_mode_and_batch_size(tmp_path):
    pytest.importorskip("matplotlib", reason='plots need matplotlib: pip install "specfx[plot]"')
    from specfx.bench.tasks.suite_report import suite_plot

    b1 = synthetic({BASELINE: {"qa": 10.0}, "hf_prompt_lookup": {"qa": 11.0}, "specfx": {"qa": 12.0}})
    b8 = synthetic({BASELINE: {"qa": 30.0}, "specfx": {"qa": 27.0}})
    runs = {"greedy": {"1": {"summary": summarise(b1, 1)}, "8": {"summary": summarise(b8, 8)}}}
    assert suite_plot(tmp_path / "suite.png", runs) == tmp_path / "suite.png"
    assert (tmp_path / "suite.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- a smoke run
@pytest.fixture(scope="module")
def smollm2(smollm2_directory, one_thread):
    from specfx.demo.smollm2 import load_smollm2

    return load_smollm2()


def smoke(model, tokenizer, out, *argv) -> dict:
    """A smoke run of the task on ``model``; its exit status must be 0 (greedy equal): the JSON."""
    args = suite.parse_args(["--quick", "--max-new-tokens", "4", "--out", str(out), *argv])
    saved = model.generation_config.to_dict()
    assert suite.run(args, model, tokenizer, "SmolLM2-135M-Instruct") == 0
    assert model.generation_config.to_dict() == saved  # HF's assisted settings restored after each call
    return json.loads((out / "suite.json").read_text())


@pytest.mark.full  # a benchmark on the real model (its pieces have default-tier tests above)
def test_smoke_run_reports_greedy_equality(smollm2, tmp_path, capsys):
    # HF's early exit (the slowest peer here) runs in the full tier's smoke run below
    report = smoke(*smollm2, tmp_path, "--categories", "code_editing", "--skip", "hf_early_exit")
    results = report["runs"]["greedy"]["1"]["methods"]
    assert set(results) == {BASELINE, "hf_prompt_lookup", "specfx"}
    res = results["specfx"]["categories"]["code_editing"]
    assert res["same_tokens_as_hf_dynamic"] is True and res["tokens"] == [4] and res["tau"] >= 1.0
    assert results["hf_prompt_lookup"]["categories"]["code_editing"]["same_tokens_as_hf_dynamic"] is True
    assert report["meta"]["machine"]["threads"] == 1 and len(report["meta"]["load_avg"]["end"]) == 3
    text = (tmp_path / "suite.md").read_text()
    assert text.count("-> **") == 3 and "| code_editing |" in text  # the three targets, each PASS or FAIL
    assert "-> **PASS**" in text or "-> **FAIL**" in text
    out = capsys.readouterr().out
    assert "command: specfx bench suite --quick" in out and "load average at start" in out


@pytest.mark.full
def test_smoke_run_left_padded_and_sampling(smollm2, tmp_path):
    argv = ["--categories", "translation", "--batch-sizes", "1,3", "--modes", "greedy,sample", "--num-prompts", "2"]
    report = smoke(*smollm2, tmp_path, *argv)
    for mode in ("greedy", "sample"):
        b1, b3 = report["runs"][mode]["1"]["methods"], report["runs"][mode]["3"]["methods"]
        assert set(b1) == {BASELINE, "hf_prompt_lookup", "hf_early_exit", "specfx"} and set(b3) == {BASELINE, "specfx"}
        res = b3["specfx"]["categories"]["translation"]  # one batch: prompts 1, 2, 1, left-padded
        assert res["tokens"][0] > 0 and res["tau"] >= 1.0
        assert res.get("same_tokens_as_hf_dynamic") is (True if mode == "greedy" else None)
        assert report["runs"][mode]["3"]["summary"]["specfx"]["targets"] == []
    assert (tmp_path / "suite.png").read_bytes()[:4] == b"\x89PNG"
