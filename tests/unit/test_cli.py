"""``specfx demo --pair`` and ``specfx bench`` smoke tests on the shipped pair (eager, a few tokens);
the default ``specfx demo`` (SmolLM2) is tested in tests/unit/demo/test_chat_demo.py."""

import json

import pytest
import torch

from specfx.bench.harness import hf_assisted_kwargs
from specfx.cli import main
from specfx.demo.pair import load_demo_pair
from specfx.demo.stream import MarkingStreamer, render_marked


def test_marking_streamer_marks_all_but_the_last_token_of_a_round():
    s = MarkingStreamer()
    s.put(torch.tensor([[5, 6, 7]]))  # the prompt: not recorded
    s.put_round([1])
    s.put(torch.tensor([8]))  # prefill's token: from the target
    s.put_round([3])  # a round: two accepted proposals, then the correction, put one by one
    for t in (9, 10, 11):
        s.put(torch.tensor([t]))
    s.put_round([2])  # a round cut short after its first token (a stopping criterion)
    s.put(torch.tensor([12]))
    s.end()
    assert s.tokens == [(8, False), (9, True), (10, True), (11, False), (12, True)]


def test_marking_streamer_on_a_generation():
    """specfx tells the streamer each round's size before putting its tokens one at a time."""
    import specfx
    from tests.conftest import pair, prompt

    target, draft = pair("llama", "self")  # every proposal accepted
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    s = MarkingStreamer()
    out = spec.generate(prompt(6), max_new_tokens=9, streamer=s)
    assert [t for t, _ in s.tokens] == out[0, 6:].tolist()
    assert [m for _, m in s.tokens] == [False] + [True, True, True, False] * 2


def test_render_marked_wraps_accepted_runs():
    _, _, tok = load_demo_pair()
    ids = tok("x = 1\ny = 2", add_special_tokens=False).input_ids
    marks = [False] + [True] * (len(ids) - 2) + [False]
    text = render_marked(tok, list(zip(ids, marks, strict=True)), color=False)
    assert text.replace("«", "").replace("»", "") == "x = 1\ny = 2"
    assert text.count("«") == 1 and text.count("»") == 1
    assert "\033[" in render_marked(tok, list(zip(ids, marks, strict=True)), color=True)


def test_demo_smoke(one_thread, tmp_path, capsys):
    plot = tmp_path / "demo.png"
    argv = ["demo", "--pair", "--no-compile", "--max-new-tokens", "12", "--num-prompts", "1", "--repeats", "1"]
    rc = main(argv + ["--plot", str(plot)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "greedy output identical to HF generate(): yes" in out
    assert "τ (tokens per round) = " in out and "α (acceptance rate) = " in out
    for method in ("HF generate()", "HF assisted (K=4)", "specfx eager"):
        assert method in out
    assert "--- completion ---" in out
    assert "torch.float32 (shipped as float16), 1 torch thread(s)" in out  # what the speed depends on
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {plot.resolve()}" in out


def test_bench_smoke(one_thread, tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--no-compile",
            "--k",
            "2",
            "--batch-sizes",
            "1,2",
            "--max-new-tokens",
            "8",
            "--num-prompts",
            "2",
            "--repeats",
            "1",
            "--skip",
            "hf_static",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    one, two = result["runs"]["1"], result["runs"]["2"]
    assert set(one) == {"hf_dynamic", "hf_assisted@2", "specfx_eager@2"}
    assert "hf_assisted@2" not in two  # HF refuses assisted generation for batch > 1
    for res in (one, two):
        assert all(r["status"] == "ok" and r["same_tokens_as_hf_dynamic"] for r in res.values())
    stats = one["specfx_eager@2"]["stats"]
    assert stats["proposed"] > 0 and len(stats["per_position_rate"]) == 2
    assert "| 1 | specfx_eager@2 |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out


def test_named_drafters_map_to_hf_equivalents():
    assert hf_assisted_kwargs("prompt_lookup", 3) == {"prompt_lookup_num_tokens": 3}
    assert hf_assisted_kwargs("early_exit:2", 4) == {"assistant_early_exit": 2}
    assert hf_assisted_kwargs("mtp", 4) == {"use_mtp": True}
    with pytest.raises(ValueError, match="no HF counterpart"):
        hf_assisted_kwargs("nonsense", 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--k", "0"], "must be >= 1"),
        (["demo", "--pair", "--k", "0"], "must be >= 1"),
        (["bench", "--k", "two"], "--k takes comma-separated integers or 'auto', --batch-sizes integers; got 'two'"),
        (["bench", "--batch-sizes", "0"], "--batch-sizes a positive integer"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
