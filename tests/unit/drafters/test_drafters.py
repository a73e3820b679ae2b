"""The drafter registry (declarative, no import side effects), what ``draft=`` accepts, and the
one K-step draft loop (:func:`specfx.drafters.drafting.draft_chain`) every model-based drafter uses."""

import os
import subprocess
import sys

import pytest
import torch

import specfx
from specfx.drafters import drafting
from specfx.drafters.drafting import draft_chain
from specfx.drafters.registry import DEFAULT_DRAFTERS, NAMED_DRAFTERS, resolve_drafter
from tests.conftest import pair

# the repository root (tests/unit/drafters/ is three levels below it)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# --------------------------------------------------------------------------- registry
def test_registry_resolves_names_without_importing_the_drafter_modules_first():
    """specfx.drafters.registry alone (the package's __init__, which imports every drafter, skipped)
    resolves every name: the tables declare the drafters, importing a module registers nothing."""
    code = f"""
import sys, types
package = types.ModuleType("specfx")
package.__path__ = [{os.path.join(ROOT, "specfx")!r}]
sys.modules["specfx"] = package  # no specfx/__init__.py: nothing else is imported
from specfx.drafters.registry import NAMED_DRAFTERS, resolve_drafter
assert not any(m in sys.modules for m in ("specfx.drafters.prompt_lookup", "specfx.drafters.early_exit", "specfx.drafters.mtp"))
before = dict(NAMED_DRAFTERS)
print(type(resolve_drafter("prompt_lookup:4", None)).__name__, resolve_drafter("prompt_lookup:4", None).max_ngram)
print(resolve_drafter("early_exit:2", None))
print(type(resolve_drafter("mtp", None)).__name__)
assert NAMED_DRAFTERS == before, "importing a drafter module changed the registry"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["PromptLookup 4", "EarlyExit(layer=2)", "MTP"]


def test_default_drafters_are_declared_in_order():
    assert [name for name, _ in DEFAULT_DRAFTERS] == ["mtp", "prompt_lookup"]
    assert set(NAMED_DRAFTERS) >= {"prompt_lookup", "early_exit", "mtp"}


def test_a_user_factory_registers_as_a_callable(monkeypatch):
    monkeypatch.setitem(NAMED_DRAFTERS, "mine", lambda arg: specfx.PromptLookup(max_ngram=int(arg or 2)))
    assert resolve_drafter("mine:5", None) == specfx.PromptLookup(max_ngram=5)


# --------------------------------------------------------------------------- draft= as a path
@pytest.mark.parametrize("draft", ["/path/to/model", "org/draft-model", "./draft", "DIR"])
def test_a_path_or_hub_id_as_draft_says_to_load_the_model(draft, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()  # an existing directory without a slash in its name
    target = pair("llama", "self")[0]
    with pytest.raises(ValueError, match=r"takes a model object") as error:
        specfx.speculate(target, draft=draft, compile=False)
    message = str(error.value)
    assert f"draft=AutoModelForCausalLM.from_pretrained({draft!r})" in message
    assert "'eagle', 'eagle3', 'early_exit', 'lookahead', 'medusa', 'mtp', 'pard', 'prompt_lookup'" in message  # the named drafters are listed too
    assert f"'eagle3:{draft}'" in message  # and how to name a head checkpoint
    assert "unknown drafter" not in message


def test_an_unknown_name_is_still_an_unknown_drafter():
    with pytest.raises(ValueError, match=r"unknown drafter .ngram.\. Named drafters: .*from_pretrained\(name\)"):
        resolve_drafter("ngram", None)


# --------------------------------------------------------------------------- draft_chain
class _Ctx:
    k = 3


def _fake_draft_token():
    """draft_token's contract (choose a token, append it and the distribution it would be
    sampled from to ``qs``) without its logits processing, so these tests follow the loop only."""

    def draft_token(ctx, logits, i, proposals, qs):
        token = logits.argmax(dim=-1)  # [B, 1]
        qs.append(logits.softmax(dim=-1))
        proposals.append(token)
        return token

    return draft_token


def _one_hot(tokens, vocab=16):
    return torch.nn.functional.one_hot(tokens % vocab, vocab).float()  # [B, 1, V]


@pytest.mark.parametrize("k", [1, 3])
def test_draft_chain_feeds_each_proposal_to_the_next_step(k, monkeypatch):
    monkeypatch.setattr(drafting, "draft_token", _fake_draft_token())
    ctx = _Ctx()
    ctx.k = k
    calls = []

    def step(i, proposals):
        calls.append((i, len(proposals)))
        return _one_hot(proposals[-1] + torch.tensor([[1], [2]]))  # row 0 counts by 1, row 1 by 2

    proposals, q = draft_chain(ctx, _one_hot(torch.tensor([[3], [5]])), step)
    expected = torch.stack([torch.tensor([3, 5]) + torch.tensor([1, 2]) * j for j in range(k)], dim=1)
    assert torch.equal(proposals, expected)  # [B, K]
    assert calls == [(i, i) for i in range(1, k)]  # step i sees i proposals; none after the last
    assert q.shape == (2, k, 16)  # one distribution per proposal (read only when sampling)


def test_draft_chain_returns_the_distributions_it_sampled_from(monkeypatch):
    monkeypatch.setattr(drafting, "draft_token", _fake_draft_token())
    logits = torch.randn(2, 1, 5)
    proposals, q = draft_chain(_Ctx(), logits, lambda i, p: logits * (i + 1))
    assert proposals.shape == (2, 3) and q.shape == (2, 3, 5)
    assert torch.allclose(q[:, 2], (logits[:, 0] * 3).softmax(-1))
