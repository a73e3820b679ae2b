"""Shared fixtures, and the two tiers of the suite.

``python -m pytest -q -n auto tests`` (the README's test command) runs the default tier: every
feature, on a representative set of architectures, in under ten minutes on a fresh 2-core CPU
(decision 96). ``--full`` adds the tests marked ``full`` (every architecture of the conformance
matrix, every parametrisation, every drafter's lossless proof); CI runs it but for the tests marked
``exhaustive`` and the Inductor tests not marked ``ci``. Markers (``pyproject.toml``): ``full``,
``compiled`` (compiles with Inductor: enforced below), ``ci``, ``exhaustive``, ``cuda``.
"""

import gc
import os
from contextlib import contextmanager

import pytest
import torch
from torch._dynamo.utils import counters

import specfx
from specfx.drafters.base import Drafter
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm

ARCHS = ("llama", "qwen2", "gpt2")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked 'full' (the whole conformance matrix and every parametrisation; CI runs it)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:  # deselected, not skipped: the tier is chosen, nothing is hidden behind a skip
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


def pytest_configure(config):
    # pytest-xdist workers share the cores: torch's intra-op threads are split between them
    # (two workers with two threads each on two cores spend their time waiting for a core)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# A worker's resident memory above which a test's teardown runs Python's cyclic collector. specfx
# frees a dropped generator by reference counting (tests/api/test_release.py), but Dynamo's traces
# leave cyclic garbage pointing at what they traced (a 6000-row generator's KV buffers, in the
# lossless tests) until the collector happens to run; two workers on a 24 GB machine must not wait
# for it (CI of 031a895 lost a worker that way). A full collection costs ~0.2 s: only when needed.
_COLLECT_ABOVE = 3 << 30


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: no guard
        return 0


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if _resident_bytes() > _COLLECT_ABOVE:
        gc.collect()


def pytest_report_header(config):
    tier = "full (--full)" if config.getoption("--full") else "default (tests marked 'full' deselected; --full runs them)"
    return f"specfx test tier: {tier}"


def tiered(values, default, *, several: bool = False, ci=None):
    """``values`` for ``parametrize``, those not in ``default`` marked ``full``: the default tier
    runs a representative subset, ``--full`` every value. ``ci``: the values CI's newest-release run
    takes besides ``default`` (None: all); the others are also marked ``exhaustive`` (per-architecture
    repeats of a matrix whose other entries CI runs: ``pytest --full`` only; decision 96).
    ``several``: each value is a tuple of several arguments (``parametrize(("a", "b"), ...)``)."""

    def marks(v):
        if v in default:
            return ()
        return (pytest.mark.full,) if ci is None or v in ci else (pytest.mark.full, pytest.mark.exhaustive)

    return [
        v if not marks(v) else pytest.param(*v, marks=marks(v)) if several else pytest.param(v, marks=marks(v))
        for v in values
    ]


INDUCTOR_IN_FULL = (pytest.mark.full, pytest.mark.compiled)  # the marks of a --full-only Inductor variant


def round_backends() -> list:
    """``backend`` values for a test of compiled rounds: ``"specfx_eager"`` (Dynamo's trace of the
    round and specfx's passes, run without Inductor: a few seconds) in the default tier, and
    ``"specfx"`` (the same graph lowered by Inductor: 20-90 s per graph on a fresh 2-core machine)
    marked ``full`` and ``compiled`` (decisions 92, 96). For drafters whose kind of round another
    default-tier test already lowers with Inductor (the draft model's greedy round, early exit's
    tree, an MTP round with taps, Qwen3-Next; CI's newest run adds the sampling round, prompt
    lookup, EAGLE-3's tree, the skinny-linear rewrite and the scoped options, marked ``ci``), so that the README's test command stays under ten
    minutes on a fresh machine; ``pytest --full`` runs both."""
    return ["specfx_eager", pytest.param("specfx", marks=INDUCTOR_IN_FULL)]


def _inductor_compiles() -> int:
    return sum(counters["inductor"].values())


@pytest.fixture(autouse=True)
def _compiled_marker_is_honest(request):
    """A test that compiles with Inductor must say so (``@pytest.mark.compiled``), so that the
    marker selects exactly the slow compiling tests."""
    before = _inductor_compiles()
    yield
    specfx.wait_for_graphs()  # this test's background compiles count for it, not for the next one
    if _inductor_compiles() > before and request.node.get_closest_marker("compiled") is None:
        pytest.fail(f"{request.node.nodeid} compiled with Inductor but is not marked @pytest.mark.compiled")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def prompt(length: int, batch: int = 1, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def left_padded(length: int, pads, seed: int = 0, vocab: int = 128):
    """A left-padded batch ``(ids, attention_mask)``: row b starts with ``pads[b]`` padding
    tokens (id 0, mask 0) followed by random prompt tokens."""
    ids = prompt(length, batch=len(pads), vocab=vocab, seed=seed)
    mask = (torch.arange(length) >= torch.tensor(pads).unsqueeze(1)).long()
    return ids * mask, mask


@contextmanager
def unchanged(model):
    """Assert, on leaving the block, that ``model``'s parameters and buffers are what they were
    on entering it (the user's model is never changed)."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    yield
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items())


def active_rounds(rounds, prompt_lengths, new: int):
    """From a recording drafter's rounds ``(lengths [B], tokens [B, C], proposals)``, yield
    ``(row, committed, proposals)`` for every row still generating in that round: ``committed``
    the row's tokens up to and including the pending one (finished rows are carried along and
    skipped; ``new`` is max_new_tokens)."""
    for lengths, tokens, proposals in rounds:
        for b, prompt_length in enumerate(prompt_lengths):
            pending = int(lengths[b])
            if pending + 1 - prompt_length < new:
                yield b, tokens[b, : pending + 1].tolist(), proposals


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP
    workers waiting for a core make many small forwards 10-20x slower. Restored afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


_cache = {}


def pair(arch: str, draft: str = "perturbed"):
    """Cached (target, draft): draft is 'self' (alpha = 1), 'perturbed' (partial acceptance) or
    'small' (an independent 1-layer model: acceptance near 0)."""
    key = (arch, draft)
    if key not in _cache:
        target = tiny_causal_lm(arch)
        if draft == "self":
            d = target
        elif draft == "perturbed":
            d = perturbed_copy(target, 0.03)
        else:
            d = tiny_causal_lm(arch, num_layers=1, seed=7)
        _cache[key] = (target, d)
    return _cache[key]


class WrongEveryThird(Drafter):
    """Proposes each row's reference continuation (``table [B, C]``, slot == position), every
    position divisible by 3 replaced by another token: rounds accept 0..2 proposals (the stateful
    and compressed-KV targets' tests, whose rollback or windows only a rejecting round exercises)."""

    name = "wrong_every_third"

    def __init__(self, table: torch.Tensor, vocab: int):
        self.table, self.vocab = table, vocab

    def propose(self, ctx):
        b = ctx.lengths.shape[0]  # the batch bucket: rows past the call's repeat the table's
        pos = ctx.lengths.unsqueeze(1) + 1 + torch.arange(ctx.k)  # [B, K]
        table = self.table[torch.arange(b) % self.table.shape[0]]
        right = table.gather(1, pos.clamp(max=table.shape[1] - 1))
        return torch.where(pos % 3 == 0, (right + 1) % self.vocab, right), None
