"""The GPU benchmark's pure helpers: the busy fraction of a kernel timeline and --inductor-options."""

from __future__ import annotations

import pytest

from specfx.bench.tasks.gpu import _options, parse_args
from specfx.bench.tasks.gpu_combo import busy_in_window


def test_busy_fraction_counts_overlaps_once_and_ignores_kernels_before_the_window():
    kernels = [(0, 50), (100, 110), (105, 120), (150, 200), (230, 240)]  # µs; the first is before the window
    r = busy_in_window(kernels, start=100)
    # covered: 100-120, 150-200, 230-240 = 80 µs of a 140 µs span; gaps 30 and 30
    assert r["busy_fraction"] == pytest.approx(80 / 140, abs=1e-4)
    assert r["kernels"] == 4
    assert r["gaps_over_20us"] == 2
    assert r["largest_gaps_us"] == [30.0, 30.0]
    assert r["idle_ms"] == pytest.approx(0.06)


def test_busy_fraction_of_nothing_is_none():
    assert busy_in_window([], start=0)["busy_fraction"] is None


def test_inductor_options_parse():
    assert _options("coordinate_descent_tuning=1, max_autotune=false,triton.foo=x,a=3,b=0.5") == {
        "coordinate_descent_tuning": True,
        "max_autotune": False,
        "triton.foo": "x",
        "a": 3,
        "b": 0.5,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _options("coordinate_descent_tuning")


def test_unknown_inductor_option_is_a_usage_error():
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--inductor-options", "not_an_inductor_setting=1"])
    args = parse_args(["--smoke", "--inductor-options", "coordinate_descent_tuning=1", "--profile"])
    assert args.inductor_options == {"coordinate_descent_tuning": True} and args.profile


# ----------------------------------------------------------------------------- "auto" (issue 30)
def _plan_args(*extra):
    return parse_args(["--shapes", "8b-1b", "--batches", "1", "--contexts", "512", "--assume", "graph_s=10",
                       "--assume", "layer_s=1", *extra])  # fmt: skip


def test_auto_rows_and_families():
    from specfx.bench.tasks.gpu_plan import auto_ks, family, method_rows

    args = _plan_args("--methods", "hf_static_compiled,specfx_oracle,specfx_auto_oracle,specfx_auto",
                      "--alphas", "1", "--auto-alphas", "0,0.6", "--auto-k-values", "2,4")  # fmt: skip
    rows = method_rows(args, 1)
    assert rows == ["hf_static_compiled", "specfx_oracle_1", "specfx_auto_oracle_0", "specfx_auto_oracle_0.6",
                    "specfx_auto"]  # fmt: skip
    assert [family(r) for r in rows] == ["hf_static_compiled", "specfx_oracle", "specfx_auto_oracle",
                                         "specfx_auto_oracle", "specfx_auto"]  # fmt: skip
    assert auto_ks(args) == (0, 2, 4)
    assert parse_args(["--smoke"]).auto_k_values == (1, 2, 4, 8)  # the library's default set


def test_auto_warm_up_prediction_counts_one_round_graph_per_candidate_k():
    """8B target (32 layers), 1B draft (16): "auto" compiles K = 0 and every --auto-k-values round
    (graph_s + layer_s x decoder layers unrolled), the oracle's rounds reading the target only."""
    from specfx.bench.tasks.gpu_plan import Predictor

    methods = ["--methods", "hf_static_compiled,specfx_auto_oracle,specfx_auto", "--no-overhead"]
    small = _plan_args(*methods, "--auto-k-values", "4")
    steps = Predictor(small).steps("8b-1b", 1, 512)
    assert steps["specfx_auto_oracle_0"][0] == pytest.approx(2 * (10 + 32), abs=1)  # K = 0 and K = 4
    assert steps["specfx_auto_oracle_0.6"][0] == 0.0  # the same generator: nothing more compiles
    assert steps["specfx_auto"][0] == pytest.approx((10 + 32) + (10 + 32 + 4 * 16), abs=1)
    full = Predictor(_plan_args(*methods)).steps("8b-1b", 1, 512)  # K = 0, 1, 2, 4, 8
    assert full["specfx_auto_oracle_0"][0] == pytest.approx(5 * (10 + 32), abs=1)
    assert full["specfx_auto"][0] == pytest.approx(5 * (10 + 32) + (1 + 2 + 4 + 8) * 16, abs=2)
    # the oracle at α = 0.6 is priced at its best K, below plain decoding's α = 0 (K = 0)
    assert steps["specfx_auto_oracle_0.6"][1] < steps["specfx_auto_oracle_0"][1]


def test_auto_combination_has_a_reference_and_no_round_overhead_parts():
    from specfx.bench.tasks.gpu_plan import Predictor

    args = _plan_args("--methods", "specfx_auto_oracle", "--auto-k-values", "4")
    p = Predictor(args)
    steps = p.steps("8b-1b", 1, 512)
    calls = 1 + args.repeats
    per_call = steps["specfx_auto_oracle_0"][1] + steps["specfx_auto_oracle_0.6"][1]
    expected = steps["specfx_auto_oracle_0"][0] + calls * per_call
    assert p.combo("8b-1b", 1, 512) == pytest.approx(expected + steps["reference"][1])  # no "parts" compile


def test_bad_auto_options_are_usage_errors():
    for bad in (["--auto-k-values", "4,2"], ["--auto-k-values", "0,4"], ["--auto-alphas", "1.5"]):
        with pytest.raises(SystemExit):
            parse_args(["--smoke", *bad])
