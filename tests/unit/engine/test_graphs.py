"""The graph LRU (:class:`specfx.engine.graphs.GraphCache`): a variant is reused, the least
recently used is evicted at the bound with its code released, and the live-KV bound only grows.
torch.compile is replaced by the identity: nothing compiles."""

import pytest

from specfx.engine import graphs as graphs_module
from specfx.engine.graphs import GraphCache


class _Owner:
    def __init__(self):
        self.calls = 0


def _impl(self, x):
    self.calls += 1
    return x + 1


@pytest.fixture
def released(monkeypatch):
    codes = []
    monkeypatch.setattr(graphs_module.torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(graphs_module, "release_code", lambda *cs: codes.extend(cs))
    return codes


def test_a_variant_is_reused_and_compiled_once(released):
    cache, owner = GraphCache("eager", max_graphs=4, live_kv=True), _Owner()
    key = cache.key("round", 1, 256, 2, "mode", False)
    fn = cache.variant(key, _impl, owner)
    assert fn(1) == 2 and fn(5) == 6 and owner.calls == 2
    assert cache.variant(key, _impl, owner) is not None and cache.keys() == [key]
    assert [e.key for e in cache.compile_events] == [key]  # one compile event: the first call only


def test_least_recently_used_is_evicted_and_its_code_released(released):
    cache, owner = GraphCache("eager", max_graphs=2, live_kv=True), _Owner()
    a, b, c = (cache.key("round", 1, 256, k, "mode", False) for k in (1, 2, 4))
    cache.variant(a, _impl, owner)
    cache.variant(b, _impl, owner)
    code_a = cache.code(a)
    cache.variant(a, _impl, owner)  # a is now the most recently used
    code_b = cache.code(b)
    cache.variant(c, _impl, owner)
    assert cache.keys() == [a, c] and released == [code_b]
    assert code_a is not code_b  # each variant has its own code object
    with pytest.raises(KeyError):
        cache.code(b)


def test_live_bound_grows_and_evicts_the_outgrown(released):
    cache, owner = GraphCache("eager", max_graphs=8, live_kv=True), _Owner()
    assert cache.live_slots(256) == 256  # no call yet: the whole capacity
    assert cache.live_bound(65, 256) == 80 and cache.live_bound(300, 256) == 256
    cache.grow_live(256, 80)
    first = cache.key("round", 1, 256, 2, "mode", False)
    assert first[-1] == 80
    cache.variant(first, _impl, owner)
    cache.grow_live(256, 64)  # never shrinks: the graph stays
    assert cache.live_slots(256) == 80 and cache.keys() == [first]
    cache.grow_live(256, 112)
    assert cache.live_slots(256) == 112 and cache.keys() == [] and len(released) == 1
    assert GraphCache("eager", 8, live_kv=False).live_bound(65, 256) == 256  # live_kv=False: no cut
