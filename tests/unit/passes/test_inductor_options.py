"""SpecConfig.inductor_options: checked at speculate(), handed to Inductor as the config patches
of specfx's own compiles only, and never left in Inductor's process-wide config."""

from __future__ import annotations

import pytest
import torch
from torch._inductor import compile_fx as compile_fx_module
from torch._inductor import config as inductor_config

import specfx
from specfx.passes.backend import make_backend
from specfx.testing.tiny import tiny_causal_lm


def test_unknown_key_is_refused():
    with pytest.raises(ValueError, match="not torch._inductor.config settings"):
        specfx.SpecConfig(inductor_options={"coordinate_descent_tunning": True})


def test_needs_the_inductor_backend():
    with pytest.raises(ValueError, match="backend='specfx'"):
        specfx.SpecConfig(backend="specfx_eager", inductor_options={"coordinate_descent_tuning": True})


def test_not_a_mapping_is_refused():
    with pytest.raises(ValueError, match="must be a dict"):
        specfx.SpecConfig(inductor_options=[("coordinate_descent_tuning", True)])


@pytest.mark.compiled
def test_patches_reach_compile_fx_and_do_not_outlive_it(monkeypatch):
    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    before = inductor_config.coordinate_descent_tuning
    fn = torch.compile(
        lambda x: torch.relu(x) * 2,
        backend=make_backend("specfx", options={"coordinate_descent_tuning": not before}),
        fullgraph=True,
    )
    x = torch.randn(8)
    torch.testing.assert_close(fn(x), torch.relu(x) * 2)
    assert seen and seen[0]["coordinate_descent_tuning"] is (not before)
    assert inductor_config.coordinate_descent_tuning is before  # scoped to that compile


@pytest.mark.compiled
@pytest.mark.full
@pytest.mark.ci
def test_generator_compiles_with_them(monkeypatch):
    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    model = tiny_causal_lm("llama", seed=0)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    spec = specfx.speculate(
        model,
        draft="prompt_lookup",
        num_speculative_tokens=2,
        background_compile=False,
        inductor_options={"fallback_random": True},
    )
    out = spec.generate(ids, max_new_tokens=6)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    # compile_fx re-enters itself under the patches with none of its own: count the outer calls
    assert [p for p in seen if p] and all(p.get("fallback_random") is True for p in seen if p)
