"""benchmarks/hybrid_rounds.py's smoke mode (issue 29 item 4): it runs, and what it reports is checked."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "hybrid_rounds.py"


def _script():
    spec = importlib.util.spec_from_file_location("hybrid_rounds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.full  # a benchmark's smoke (the rule it shows has its own test in test_auto_k.py)
def test_smoke_rounds_equal_hf_and_time_the_rollback(capsys):
    (case,) = _script().main(["--smoke"])["cases"]
    methods = case["methods"]
    assert set(methods) == {"hf_dynamic", "k0", "k4@a0", "k4@a1", "auto@a0", "auto@a1", "wait@a0"}
    for name, result in methods.items():
        assert result["status"] == "ok", (name, result)
        if name != "hf_dynamic":
            assert result["same_tokens_as_hf_dynamic"], (name, result["first_mismatch_per_prompt"])
    split = case["split_ms"]
    # the pieces were found and timed in the round itself (a wrapper that missed one reads 0)
    for piece in ("draft", "verify", "replay", "rollback"):
        assert split[piece] > 0, (piece, split)
    assert split["rollback"] == split["snapshot"] + split["restore"] + split["replay"] + split["select"]
    assert split["select"] == 0  # GDN verifies in one multi-token forward: its rollback replays steps
    # "auto" measured a round time for K = 0 and for K = 4 (the rounds it chooses by)
    assert {"0", "4"} <= set(case["auto_times_ms"])
    # at α = 0 "auto" ends plain (by the evidence, or at once where the times say no K pays)
    assert case["auto_history"]["auto@a0"][-1] == 0 and case["auto_history"]["wait@a0"][-1] == 0
    assert "| qwen3_next-tiny:eager:1 |" in capsys.readouterr().out
