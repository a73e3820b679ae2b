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
