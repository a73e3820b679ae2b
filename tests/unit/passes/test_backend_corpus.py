"""The registered backends on ordinary user code: every function compiled with
``backend="specfx_eager"`` (and a representative few with ``"specfx"``, Inductor, which costs
seconds per graph on a CPU) must give what eager gives, inputs it mutates included.

The round invariants (no host sync, static KV) are specfx's own business and must never reject
a user's function; the rewrites must prove their preconditions from node shapes or skip.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specfx.model.hf_names import cache_kwarg
from specfx.passes import make_backend
from specfx.testing.tiny import tiny_causal_lm

W = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))  # [V=8, H=4]
B8 = torch.randn(8, generator=torch.Generator().manual_seed(1))
BIAS_TV = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))  # broadcasts per position


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def item_branch(x):
    if x.sum().item() > 0:  # host sync and a graph break
        return x * 2
    return x - 1


def inplace_add(x):
    x.add_(1)
    return x * 2


def setitem_input(x):
    x[0] = 5.0
    return x.sum(0)


def index_put_input(x, idx, v):
    x[idx] = v
    return x * 1


def graph_break_in_the_middle(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y + x.cos()


def unused_random_then_random(x):
    torch.rand(3)  # unused, but it advances the generator: removing it changes the next draw
    return x + torch.rand_like(x)


def unused_dropout(x):
    F.dropout(x, 0.5, True)  # unused; draws random numbers all the same
    return x + torch.rand_like(x)


def unused_batch_norm(x, running_mean, running_var):
    F.batch_norm(x, running_mean, running_var, training=True)  # updates the running stats
    return x + 1


def unused_relu_inplace(x):
    F.relu(x, True)  # in place through a positional flag
    return x * 1


def out_kwarg(x, y):
    torch.add(x, 1, out=y)
    return x * 2


def linear_used_twice(h):
    logits = F.linear(h, W)
    return logits[:, -1], logits.sum()


# id -> (function, inputs factory). The factory is called once per run, so in-place updates
# start from the same values in eager and compiled runs.
CORPUS = {
    "cpu_plus_one": (lambda x: x.cpu() + 1, lambda: (rand(3),)),
    "linear_2d_feature_slice": (lambda x: F.linear(x, W)[:, :2], lambda: (rand(3, 4),)),
    "linear_3d_last_position": (lambda h: F.linear(h, W)[:, -1], lambda: (rand(2, 5, 4),)),
    "linear_3d_softcap_last": (
        lambda h: (torch.tanh(F.linear(h, W, B8).float() / 3.0) * 3.0)[:, -1:],
        lambda: (rand(2, 5, 4),),
    ),
    "linear_4d_select_dim1": (lambda h: F.linear(h, W)[:, 1], lambda: (rand(2, 3, 5, 4),)),
    "linear_3d_feature_slice": (lambda h: F.linear(h, W)[..., :2], lambda: (rand(2, 5, 4),)),
    "linear_3d_full_index_last_dim": (lambda h: F.linear(h, W)[:, :, 3], lambda: (rand(2, 5, 4),)),
    "linear_2d_row_slice": (lambda x: F.linear(x, W, B8)[:3], lambda: (rand(6, 4),)),
    "linear_plus_tensor_then_last": (lambda h: (F.linear(h, W) + BIAS_TV)[:, -1], lambda: (rand(2, 5, 4),)),
    "linear_used_twice": (linear_used_twice, lambda: (rand(2, 5, 4),)),
    "item_branch": (item_branch, lambda: (rand(4),)),
    "tolist_sum": (lambda x: sum(x.tolist()), lambda: (rand(4),)),
    "nonzero": (lambda x: torch.nonzero(x > 0), lambda: (rand(3, 4),)),
    "boolean_mask": (lambda x: x[x > 0] * 2, lambda: (rand(3, 4),)),
    "unique": (lambda x: torch.unique(x), lambda: (torch.tensor([3, 1, 3, 2, 1]),)),
    "cat_inputs": (lambda x, y: torch.cat([x, y], dim=0), lambda: (rand(2, 3), rand(1, 3, seed=1))),
    "inplace_add": (inplace_add, lambda: (rand(3),)),
    "setitem_input": (setitem_input, lambda: (rand(3, 2),)),
    "index_put_input": (index_put_input, lambda: (rand(4, 2), torch.tensor([0, 2]), rand(2, 2, seed=1))),
    "softmax": (lambda x: torch.softmax(x, dim=-1), lambda: (rand(2, 5),)),
    "matmul_argmax": (lambda x, y: (x @ y).argmax(-1), lambda: (rand(3, 4), rand(4, 6, seed=1))),
    "integer_ops": (lambda x: (x // 3) % 2 + x.cumsum(0), lambda: (torch.arange(10),)),
    "max_tuple": (lambda x: x.max(dim=-1), lambda: (rand(3, 4),)),
    "graph_break_in_the_middle": (graph_break_in_the_middle, lambda: (rand(3),)),
    "unused_random_then_random": (unused_random_then_random, lambda: (rand(3),)),
    "unused_dropout": (unused_dropout, lambda: (rand(3),)),
    "unused_batch_norm": (unused_batch_norm, lambda: (rand(4, 3), torch.zeros(3), torch.ones(3))),
    "unused_relu_inplace": (unused_relu_inplace, lambda: (rand(5),)),
    "out_kwarg": (out_kwarg, lambda: (rand(3), torch.zeros(3))),
}
# Inductor on a representative subset: the two regressions, a pruned LM head, a
# mutated input, a host sync (Inductor's random numbers differ from eager's by design).
INDUCTOR = ("cpu_plus_one", "linear_2d_feature_slice", "linear_3d_last_position", "setitem_input", "tolist_sum")
PRUNED = {"linear_3d_last_position", "linear_3d_softcap_last", "linear_4d_select_dim1"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(fn, make_inputs):
    """(output, inputs after the call), with the global generator seeded first."""
    inputs = make_inputs()
    torch.manual_seed(0)
    return fn(*inputs), inputs


@pytest.mark.parametrize(
    "backend, name",
    [("specfx_eager", n) for n in CORPUS] + [pytest.param("specfx", n, marks=pytest.mark.compiled) for n in INDUCTOR],
)
def test_registered_backend_matches_eager(backend, name):
    fn, make_inputs = CORPUS[name]
    expected = run(fn, make_inputs)
    got = run(torch.compile(fn, backend=backend), make_inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CORPUS))
def test_prune_logits_only_where_provable(name):
    """The same backend with a record of what the passes did: the LM-head selections on the
    sequence dim are pruned (and still match eager, above); nothing else is."""
    fn, make_inputs = CORPUS[name]
    records = []
    out = torch.compile(fn, backend=make_backend("specfx_eager", records, round_graphs=False))(*make_inputs())
    pruned = sum(dict(r.report.sites)["prune_logits"] for r in records)
    assert pruned == (1 if name in PRUNED else 0)
    if name in PRUNED:  # the new linear carries its (selected) shape for later passes
        lin = next(n for n in records[0].graph_module.graph.nodes if n.target is torch._C._nn.linear)
        assert lin.meta["example_value"].shape == out.shape


@pytest.mark.parametrize("name", sorted(PRUNED))
def test_pruned_heads_match_eager_with_dynamic_shapes(name):
    """Symbolic sizes in the meta (dynamic=True): ranks are still known, values still match."""
    fn, make_inputs = CORPUS[name]
    compiled = torch.compile(fn, backend="specfx_eager", dynamic=True)
    for extra in (0, 3):
        (h,) = make_inputs()
        h = torch.cat([h, h[:, :extra]], dim=1)  # a longer sequence, same function
        torch.testing.assert_close(compiled(h), fn(h))


def _forward(model):
    return lambda ids: model(input_ids=ids).logits


def _forward_cached(model):
    return lambda ids, cache: model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}).logits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_forward_matches_eager(arch, one_thread):
    model = tiny_causal_lm(arch)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _forward(model)(ids)
        got = torch.compile(_forward(model), backend="specfx_eager")(ids)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_forward_with_dynamic_cache_matches_eager(arch, one_thread):
    model = tiny_causal_lm(arch)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :5], use_cache=True, **{cache_kwarg(model): cache})
        cache_c = copy.deepcopy(cache)
        expected = _forward_cached(model)(ids[:, 5:], cache)
        got = torch.compile(_forward_cached(model), backend="specfx_eager")(ids[:, 5:], cache_c)
    torch.testing.assert_close(got, expected)
    for a, b in zip(cache.layers, cache_c.layers, strict=True):
        torch.testing.assert_close((b.keys, b.values), (a.keys, a.values))


@pytest.mark.compiled
@pytest.mark.full
@pytest.mark.ci
def test_hf_forward_under_inductor_matches_eager(one_thread):
    model = tiny_causal_lm("llama", num_layers=1)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _forward(model)(ids)
        got = torch.compile(_forward(model), backend="specfx")(ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
