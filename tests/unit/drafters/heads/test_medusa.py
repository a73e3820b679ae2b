"""Medusa heads (``draft="medusa:DIR"`` / ``specfx.drafters.heads.medusa.Medusa``).

Heads are written to a temporary directory in a public layout (FasterDecoding's
``medusa_lm_head.safetensors`` or vLLM's converted ``blocks``/``lm_heads``; by hand with
safetensors here, independently of ``Medusa.save``) and loaded by path. Random heads accept
almost nothing, so the greedy tests use *fitted* heads: random residual blocks, and LM heads
solved by least squares to map the blocks' output at a position's final hidden state to the
target's own greedy tokens 2, 3, ... positions later, on the first part of the continuations
the test then generates. The heads know those and guess the rest: proposals are accepted at
every depth early on and rejected later, so acceptance, commit and the stash are exercised.

The oracle: an independent plain-PyTorch forward of the heads' definition (``x + SiLU(W x + b)``
per block, then the head's LM head), computed from the safetensors tensors, must give every
round's proposals (argmax per head; for trees the rank-r token of head d - 1 at depth d), and
the stash the heads read must be the target's own final hidden state at the pending position
minus one.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessorList, TemperatureLogitsWarper

import specfx
from specfx.drafters.heads.medusa import Medusa
from specfx.testing.tiny import tiny_causal_lm
from specfx.trees.types import TokenTree
from tests.conftest import left_padded, prompt, round_backends, tiered
from tests.lossless.test_lossless import (
    CASES,
    NEW,
    ROWS,
    _assert_both_paths_at_several_depths,
    _chisquare,
    _exact,
    _tree_samples,
)
from tests.lossless.test_lossless import _models as lossless_models

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "mixtral")
HEADS, LAYERS = 4, 1
TREE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # depth 3, second/third children
PINNED = dict(tree=TREE, num_speculative_tokens=TREE.size)  # the tree every round, never "auto"'s K = 0
NEW_TOKENS = 30
FITTED = 16  # continuation tokens (per sequence) the fitted heads are fitted on
NO_EOS = dict(do_sample=False, eos_token_id=None)  # some tiny models emit EOS at once: rounds must run

# what the engines make of these heads is checked in test_head_engines.py
pytestmark = pytest.mark.filterwarnings("ignore::specfx.drafters.heads.checkpoint.HeadLayoutWarning")

_targets = {}


def _target(arch: str):
    if arch not in _targets:
        _targets[arch] = tiny_causal_lm(arch)
    return _targets[arch]


# --------------------------------------------------------------------------- the layouts, by hand
def _names(layout: str, i: int, j: int | None, num_layers: int) -> tuple[str, str] | str:
    """Block j's (weight, bias) names, or (j None) head i's LM head name, in a public layout."""
    if layout == "medusa":  # FasterDecoding: the state dict of its medusa_head ModuleList
        return (f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias") if j is not None else f"{i}.{num_layers}.weight"
    return (f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias") if j is not None else f"lm_heads.{i}.weight"


def _write(path, layout: str, blocks, lm_heads, config=True, prefix: str = ""):
    """Write heads by hand: ``blocks[i][j] = (W [H, H], b [H])``, ``lm_heads[i] [V, H]``."""
    path.mkdir(parents=True, exist_ok=True)
    n, m = len(lm_heads), len(blocks[0])
    tensors = {}
    for i in range(n):
        for j, (w, b) in enumerate(blocks[i]):
            wn, bn = _names(layout, i, j, m)
            tensors[prefix + wn], tensors[prefix + bn] = w.clone(), b.clone()
        tensors[prefix + _names(layout, i, None, m)] = lm_heads[i].clone()
    filename = "medusa_lm_head.safetensors" if layout == "medusa" else "model.safetensors"
    save_file(tensors, str(path / filename))
    if config is True:
        v, h = lm_heads[0].shape
        if layout == "medusa":
            config = {"medusa_num_heads": n, "medusa_num_layers": m, "base_model_name_or_path": "tiny"}
        else:
            config = {"model_type": "medusa", "num_heads": n, "num_hidden_layers": m, "hidden_size": h,
                      "vocab_size": v, "medusa_fc_bias": True}  # fmt: skip
    if config:
        (path / "config.json").write_text(json.dumps(config))
    return path


def _read(path, layout: str):
    """``(blocks, lm_heads)`` read back from the safetensors file (the oracle's weights)."""
    filename = "medusa_lm_head.safetensors" if layout == "medusa" else "model.safetensors"
    tensors = load_file(str(path / filename))
    config = json.loads((path / "config.json").read_text())
    n = config["medusa_num_heads"] if layout == "medusa" else config["num_heads"]
    m = config["medusa_num_layers"] if layout == "medusa" else config["num_hidden_layers"]
    blocks = [[tuple(tensors[x] for x in _names(layout, i, j, m)) for j in range(m)] for i in range(n)]
    return blocks, [tensors[_names(layout, i, None, m)] for i in range(n)]


def _reference_blocks(x: torch.Tensor, blocks) -> torch.Tensor:
    """A head's residual blocks as the layout defines them: x + SiLU(W x + b), in order."""
    for w, b in blocks:
        x = x + F.silu(F.linear(x, w, b))
    return x


def _reference_logits(x: torch.Tensor, blocks, lm_heads) -> torch.Tensor:
    """``[heads, ..., V]``: every head's logits at hidden states ``x [..., H]``."""
    return torch.stack([F.linear(_reference_blocks(x, blocks[i]), lm_heads[i]) for i in range(len(lm_heads))])


def _random_blocks(n, m, h, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(h, h, generator=g) * scale, torch.randn(h, generator=g) * scale) for _ in range(m)] for _ in range(n)]


def _final_hidden(target, seq: torch.Tensor) -> torch.Tensor:
    """The target's final hidden state (after the final norm) at every position of ``seq [T]``."""
    with torch.no_grad():
        return target(seq.unsqueeze(0), output_hidden_states=True).hidden_states[-1][0]


def _fitted(target, sequences, path, layout="medusa", n=HEADS, m=LAYERS, fitted=FITTED, seed=0):
    """Heads whose LM heads are least-squares fits (over the first ``fitted`` positions after
    each prompt) from the blocks' output at position t to the token at t + 2 + i; written in
    ``layout`` at ``path``. ``sequences``: (prompt length, greedy sequence [T]) pairs."""
    h = target.get_output_embeddings().weight.shape[1]
    v = target.get_output_embeddings().weight.shape[0]
    blocks = _random_blocks(n, m, h, seed, scale=0.05)
    hidden = [_final_hidden(target, seq) for _, seq in sequences]
    lm_heads = []
    for i in range(n):
        xs, ys = [], []
        for (p, seq), hs in zip(sequences, hidden, strict=True):
            stop = min(len(seq) - 2 - i, p + fitted)  # positions t with t + 2 + i known and fitted
            xs.append(_reference_blocks(hs[:stop], blocks[i]))
            ys.append(seq[2 + i : 2 + i + stop])
        x, y = torch.cat(xs).double(), F.one_hot(torch.cat(ys), v).double()
        lm_heads.append(torch.linalg.lstsq(x, y).solution.T.float().contiguous())  # [V, H]
    return _write(path, layout, blocks, lm_heads)


def _greedy_cases(arch):
    """(ids, mask) cases: one prompt, then a left-padded batch (prompts of 8 and 10: past the
    tiny sliding window of 8 once generating)."""
    return [(prompt(12, seed=3), None), left_padded(10, [2, 0], seed=5)]


def _sequences(target, cases, new=NEW_TOKENS):
    """(prompt length, unpadded greedy sequence) per row of every case."""
    out = []
    for ids, mask in cases:
        got = target.generate(ids, attention_mask=mask, max_new_tokens=new, **NO_EOS)
        for b in range(ids.shape[0]):
            keep = mask[b].bool() if mask is not None else torch.ones(ids.shape[1], dtype=torch.bool)
            out.append((int(keep.sum()), torch.cat([ids[b][keep], got[b, ids.shape[1] :]])))
    return out


def _check_greedy(spec, target, ids, mask, new=NEW_TOKENS):
    kw = dict(max_new_tokens=new, attention_mask=mask, **NO_EOS)
    expected, got = target.generate(ids, **kw), spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"first differing row: {(got != expected).any(1).nonzero().flatten().tolist()}"


# --------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("arch", tiered(ARCHS, (), ci=("gemma2", "llama")))
def test_greedy_equals_hf(arch, tmp_path, one_thread):
    """Chain K=3 and a token tree, batch 1 and a left-padded batch; fitted heads (FasterDecoding's
    layout for half the architectures, vLLM's for the others) accept at depth >= 2 and reject too."""
    target = _target(arch)
    cases = _greedy_cases(arch)
    layout = "medusa" if ARCHS.index(arch) % 2 == 0 else "vllm"
    sequences = _sequences(target, cases)
    path = _fitted(target, sequences, tmp_path / "heads", layout)
    # the tiny gemma2 repeats one token forever: there every head is right and nothing is rejected
    repeats = all(len(set(seq[p:].tolist())) == 1 for p, seq in sequences)
    for shape in (dict(num_speculative_tokens=3), PINNED):
        spec = specfx.speculate(target, draft=f"medusa:{path}", compile=False, **shape)
        assert spec.method == "medusa"
        for ids, mask in cases:
            _check_greedy(spec, target, ids, mask)
        stats = spec.cumulative_stats
        # accepted at depth 2 and 3 (commit, stash past accepted proposals), and rejected too
        assert stats.per_depth[2] > 0 and (repeats or stats.per_depth[0] < stats.row_rounds), (shape, stats)


@pytest.mark.full  # the tree rounds' greedy and sampling tests stand for it by default
def test_tree_accepts_second_children(tmp_path, one_thread):
    """The tree's extra children are the heads' second and third guesses: with the same heads a
    tree accepts more depth-1 proposals than the chain (the rank-1/2 children hit sometimes)."""
    target = _target("llama")
    cases = _greedy_cases("llama")
    path = _fitted(target, _sequences(target, cases), tmp_path / "heads")
    depth1 = {}
    for key, shape in (("chain", dict(num_speculative_tokens=3)), ("tree", PINNED)):
        spec = specfx.speculate(target, draft=Medusa(path), compile=False, **shape)
        for ids, mask in cases:
            _check_greedy(spec, target, ids, mask)
        depth1[key] = spec.cumulative_stats.per_depth[0]
    assert depth1["tree"] > depth1["chain"], depth1


@pytest.mark.full
def test_vocabulary_smaller_than_the_target_lm_head(tmp_path, one_thread):
    """Heads over the first 100 ids of a target whose LM head has 128 rows (a padded LM head):
    ids past the heads' vocabulary are never proposed, and the output is still the target's."""
    target = _target("llama")
    blocks = _random_blocks(HEADS, LAYERS, 64, seed=1)
    g = torch.Generator().manual_seed(2)
    path = _write(tmp_path / "heads", "medusa", blocks, [torch.randn(100, 64, generator=g) for _ in range(HEADS)])
    heads = Recording(path)
    spec = specfx.speculate(target, draft=heads, num_speculative_tokens=4, compile=False)
    _check_greedy(spec, target, prompt(12, seed=3), None)
    assert heads.log and all(int(p.max()) < 100 for *_, p in heads.log)
    spec = specfx.speculate(target, draft=heads, **PINNED, compile=False)
    _check_greedy(spec, target, prompt(12, seed=3), None)
    assert all(int(p.max()) < 100 for *_, p in heads.log)


# --------------------------------------------------------------------------- the oracle
class Recording(Medusa):
    """Medusa that logs, per round, ``(kind, stash [B, H], lengths [B], proposals [B, K or N])``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def propose(self, ctx):
        proposals, q = super().propose(ctx)
        self.log.append(("chain", self.stash.clone(), ctx.lengths.clone(), proposals.clone()))
        return proposals, q

    def propose_tree(self, ctx):
        proposals = super().propose_tree(ctx)
        self.log.append(("tree", self.stash.clone(), ctx.lengths.clone(), proposals.clone()))
        return proposals


@pytest.mark.parametrize("layout", tiered(["medusa", "vllm"], ["medusa"]))
def test_proposals_match_a_reference_forward(layout, tmp_path, one_thread):
    """Every round's proposals are what a plain-PyTorch forward of the heads (read from the
    safetensors file, two residual blocks each) gives at the stash, and the stash is the
    target's final hidden state at the pending position minus one (a fresh full forward)."""
    target = _target("llama")
    g = torch.Generator().manual_seed(4)
    n, m = 4, 2
    path = _write(tmp_path / "heads", layout, _random_blocks(n, m, 64, seed=3), [torch.randn(128, 64, generator=g) for _ in range(n)])
    blocks, lm_heads = _read(path, layout)
    ids = prompt(12, seed=3)
    for shape in (dict(num_speculative_tokens=4), PINNED):
        heads = Recording(path)
        spec = specfx.speculate(target, draft=heads, compile=False, **shape)
        out = spec.generate(ids, max_new_tokens=20, **NO_EOS)
        hidden = _final_hidden(target, out[0])
        assert len(heads.log) >= 5
        for kind, stash, lengths, proposals in heads.log:
            pending = int(lengths[0])
            torch.testing.assert_close(stash[0], hidden[pending - 1], rtol=1e-4, atol=1e-5)
            logits = _reference_logits(stash[0], blocks, lm_heads)  # [heads, V]
            if kind == "chain":
                expected = logits.argmax(dim=-1)[: proposals.shape[1]]
            else:  # node (r_1..r_d): the r_d-th most likely token of head d - 1
                top = logits.topk(3, dim=-1).indices  # [heads, 3]
                expected = torch.stack([top[len(node) - 1, node[-1]] for node in TREE.nodes])
            assert torch.equal(proposals[0], expected), (kind, pending)


# --------------------------------------------------------------------------- sampling is lossless
TEMPERATURE = (dict(temperature=0.7), LogitsProcessorList([TemperatureLogitsWarper(0.7)]))


def _sampling_heads(tmp_path):
    """Heads for the V = 6 target of tests/lossless/test_lossless.py, fitted to 200 of its samples after
    the test's prompt (so they propose likely tokens: some accepted, some not)."""
    target, _ = lossless_models()
    torch.manual_seed(99)
    samples = target.generate(torch.tensor([[1, 4, 2]]).repeat(200, 1), do_sample=True, max_new_tokens=8, pad_token_id=0)
    return target, Medusa(_fitted(target, [(3, seq) for seq in samples], tmp_path / "heads", "vllm"))


# the default tier proves Medusa lossless by its tree sampling test; CI's newest run the chain with every
# warper, pytest --full with temperature alone too
@pytest.mark.parametrize("case", tiered(["temperature", "temperature-topk-topp"], [], ci=["temperature-topk-topp"]))
def test_chain_sampling_matches_exact_distribution(case, tmp_path, one_thread):
    target, heads = _sampling_heads(tmp_path)
    kwargs, warpers = TEMPERATURE if case == "temperature" else CASES[case]
    prompt_ids = [1, 4, 2]
    probs = _exact(target, prompt_ids, warpers)
    spec = specfx.speculate(target, draft=heads, num_speculative_tokens=3, compile=False)
    torch.manual_seed(1234)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    stats = spec.stats
    assert 0.05 < stats.acceptance_rate < 0.95 and stats.per_depth[1] > 0, stats  # accept and correct paths
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


def test_tree_sampling_matches_exact_distribution(tmp_path, one_thread):
    target, heads = _sampling_heads(tmp_path)
    probs = _exact(target, [1, 4, 2], TEMPERATURE[1])
    samples, stats = _tree_samples(target, heads, TREE, **TEMPERATURE[0])
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) > 1e-3


# --------------------------------------------------------------------------- compiled
@pytest.mark.parametrize("backend", round_backends())
def test_compiled_greedy_equals_hf(backend, tmp_path, one_thread):
    """Chain and tree compiled (the chain traced with specfx_eager, the tree with ``backend``):
    one round graph each, and a second call with another prompt length compiles nothing new."""
    target = _target("llama")
    cases = [left_padded(10, [2, 0], seed=5), left_padded(13, [3, 0], seed=6)]
    path = _fitted(target, _sequences(target, cases, new=20), tmp_path / "heads")
    for shape in (dict(num_speculative_tokens=3, backend="specfx_eager"), dict(PINNED, backend=backend, background_compile=False)):
        spec = specfx.speculate(target, draft=f"medusa:{path}", **shape)
        _check_greedy(spec, target, *cases[0], new=20)
        n = len(spec.graphs)
        _check_greedy(spec, target, *cases[1], new=16)
        assert len(spec.graphs) == n == 1, f"{shape}: {len(spec.graphs)} graphs"
        assert spec.cumulative_stats.per_depth[1] > 0


# --------------------------------------------------------------------------- checkpoints
def _same(a: Medusa, b: Medusa):
    assert torch.equal(a.weight, b.weight) and torch.equal(a.lm_head, b.lm_head)
    assert (a.bias is None and b.bias is None) or torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_save_load_round_trip(layout, tmp_path):
    heads = Medusa.random(32, 50, num_heads=3, num_layers=2, seed=1)
    back = Medusa(heads.save(tmp_path / "a", layout=layout))
    _same(heads, back)
    assert (back.num_heads, back.num_layers, back.hidden_size, back.vocab_size) == (3, 2, 32, 50)
    # the layout's own names, as the other tools read them
    blocks, lm_heads = _read(tmp_path / "a", layout)
    assert torch.equal(blocks[2][1][0], heads.weight[2, 1]) and torch.equal(lm_heads[1], heads.lm_head[1])
    _same(heads, Medusa(back.save(tmp_path / "b", layout="vllm" if layout == "medusa" else "medusa")))


def test_shared_lm_head_and_no_bias_in_vllm_layout(tmp_path):
    """vLLM's original_lm_head (one LM head for all heads) and blocks without bias load, and
    save back as such; FasterDecoding's layout gets a copy per head and zero biases."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "v"
    path.mkdir()
    tensors = {f"blocks.{i}.layers.0.weight": torch.randn(16, 16, generator=g) for i in range(3)}
    tensors["lm_heads.0.weight"] = torch.randn(40, 16, generator=g)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"num_heads": 3, "num_hidden_layers": 1, "original_lm_head": True}))
    heads = Medusa(path)
    assert heads.shared_lm_head and heads.bias is None and heads.num_heads == 3
    config = json.loads((heads.save(tmp_path / "v2", layout="vllm") / "config.json").read_text())
    assert config["original_lm_head"] is True and config["medusa_fc_bias"] is False
    _same(heads, Medusa(tmp_path / "v2"))
    as_medusa = Medusa(heads.save(tmp_path / "m", layout="medusa"))
    assert as_medusa.lm_head.shape[0] == 3 and torch.equal(as_medusa.lm_head[2], tensors["lm_heads.0.weight"])
    assert torch.equal(as_medusa.bias, torch.zeros(3, 1, 16))


def test_prefixes_and_counts_inferred_without_config(tmp_path):
    """A Medusa-2 model's ``medusa_head.`` tensors (the base model's are ignored), vLLM's
    ``medusa_heads.`` prefix, and no config.json at all (counts from the tensor names)."""
    blocks = _random_blocks(2, 1, 8, seed=0)
    lm = [torch.randn(12, 8), torch.randn(12, 8)]
    plain = Medusa(_write(tmp_path / "plain", "medusa", blocks, lm))
    full = _write(tmp_path / "full", "medusa", blocks, lm, prefix="medusa_head.")
    save_file({"model.norm.weight": torch.ones(8)}, str(full / "model-base.safetensors"))
    (full / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "num_hidden_layers": 32}))
    _same(plain, Medusa(full))
    _same(plain, Medusa(_write(tmp_path / "vllm", "vllm", blocks, lm, prefix="medusa_heads.")))
    bare = Medusa(_write(tmp_path / "bare", "vllm", blocks, lm, config=False))
    _same(plain, bare)
    assert (bare.num_heads, bare.num_layers) == (2, 1)
    assert Medusa(tmp_path / "plain", num_heads=1).num_heads == 1


@pytest.mark.full
def test_from_target_shares_the_lm_head_and_binds_to_its_dtype(one_thread):
    """Medusa's pre-training initialisation reads through the target's LM head (not a copy);
    bind() casts the heads' own tensors to the target's dtype and device and leaves the
    target as it was."""
    target = tiny_causal_lm("llama", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    heads = Medusa.from_target(target, num_heads=3)
    assert heads.lm_head.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    spec = specfx.speculate(target, draft=heads, num_speculative_tokens=3, compile=False)
    spec.generate(prompt(8, seed=1), max_new_tokens=8, **NO_EOS)
    assert heads.weight.dtype == torch.bfloat16 and heads.stash.dtype == torch.bfloat16
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    fp32 = Medusa.random(64, 128, seed=0)
    specfx.speculate(target, draft=fp32, num_speculative_tokens=2, compile=False)
    assert fp32.weight.dtype == fp32.lm_head.dtype == torch.bfloat16
    # the generator reallocates after the user casts the model; the heads follow it
    other = tiny_causal_lm("llama", seed=1)
    heads = Medusa.random(64, 128, seed=0)
    spec = specfx.speculate(other, draft=heads, num_speculative_tokens=2, compile=False)
    spec.generate(prompt(8, seed=1), max_new_tokens=4, **NO_EOS)
    assert heads.weight.dtype == torch.float32
    other.to(torch.bfloat16)
    spec.generate(prompt(8, seed=1), max_new_tokens=4, **NO_EOS)
    assert heads.weight.dtype == heads.bias.dtype == heads.stash.dtype == torch.bfloat16


# --------------------------------------------------------------------------- bad input
def test_bad_input(tmp_path):
    target = _target("llama")  # hidden 64, vocabulary 128
    blocks = _random_blocks(2, 1, 64, seed=0)
    ok = _write(tmp_path / "ok", "medusa", blocks, [torch.randn(128, 64)] * 2)

    def refused(draft, match, error=ValueError, **kw):
        with pytest.raises(error, match=match):
            specfx.speculate(target, draft=draft, compile=False, **kw)

    refused(Medusa.random(32, 128), r"hidden size 32, but the target's final hidden state .* has 64")
    refused(Medusa.random(64, 200), r"vocabulary of 200 tokens, but the target's LM head has 128 rows")
    refused("medusa", r"draft='medusa' needs the heads' checkpoint: draft='medusa:DIR'")
    refused(f"medusa:{tmp_path / 'nowhere'}", r"is not an existing local directory .* specfx never downloads")
    refused(f"medusa:{ok}", r"num_speculative_tokens=3 asks for up to 3 proposals .* medusa drafter proposes at most 2",
            num_speculative_tokens=3)  # fmt: skip
    refused(f"medusa:{ok}", r"auto_k_values=\(1, 2, 4, 8\) asks for up to 8 .* pass auto_k_values= with values <= 2",
            num_speculative_tokens="auto")  # fmt: skip
    refused(Medusa(ok), r"speculate\(tree=...\): the tree is 3 deep, but the medusa drafter proposes at most 2",
            tree=TREE)  # fmt: skip
    pickles = tmp_path / "pickle"
    pickles.mkdir()
    (pickles / "medusa_lm_head.pt").write_bytes(b"not loaded")
    refused(f"medusa:{pickles}", r"no \*\.safetensors weights. It has medusa_lm_head.pt \(pickle\), which specfx never loads")

    def broken(name, tensors, config, match):
        path = tmp_path / name
        path.mkdir()
        save_file({k: t.clone() for k, t in tensors.items()}, str(path / "model.safetensors"))
        if config is not None:
            (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            Medusa(path)

    w, b, lm = torch.zeros(64, 64), torch.zeros(64), torch.zeros(128, 64)
    broken("missing", {"0.0.linear.weight": w, "0.1.weight": lm}, None, r"missing 1 tensor\(s\) of its layout: 0\.0\.linear\.bias")
    broken("missing_head", {"0.0.linear.weight": w, "0.0.linear.bias": b, "0.1.weight": lm, "1.1.weight": lm}, None,
           r"missing 2 tensor\(s\) of its layout: 1\.0\.linear\.weight, 1\.0\.linear\.bias")  # fmt: skip
    broken("heads", {"0.0.linear.weight": w, "0.0.linear.bias": b, "0.1.weight": lm}, {"medusa_num_heads": 3},
           r"config.json says medusa_num_heads=3, but its tensors hold 1 heads")  # fmt: skip
    broken("layers", {"blocks.0.layers.0.weight": w, "lm_heads.0.weight": lm}, {"num_hidden_layers": 2},
           r"config.json says num_hidden_layers=2, but its tensors hold 1 residual blocks per head")  # fmt: skip
    broken("bias", {"blocks.0.layers.0.weight": w, "lm_heads.0.weight": lm}, {"medusa_fc_bias": True},
           r"medusa_fc_bias=True, but its residual blocks have no biases")  # fmt: skip
    broken("shape", {"blocks.0.layers.0.weight": torch.zeros(64, 32), "lm_heads.0.weight": lm}, None,
           r"blocks\.0\.layers\.0\.weight has shape \[64, 32\], expected \[64, 64\]")  # fmt: skip
    broken("token_map", {"blocks.0.layers.0.weight": w, "lm_heads.0.weight": lm, "token_map": torch.arange(128)},
           None, r"has a token_map .* specfx does not support those")  # fmt: skip
    broken("other", {"model.embed_tokens.weight": lm}, None, r"is in no Medusa layout: it has model\.embed_tokens\.weight")
    broken("stray", {"0.0.linear.weight": w, "0.0.linear.bias": b, "0.1.weight": lm, "0.extra": b}, None,
           r"tensors that are not part of its layout: 0\.extra")  # fmt: skip
    with pytest.raises(ValueError, match=r"Medusa\(num_heads=3\): .* holds only 2 heads"):
        Medusa(ok, num_heads=3)
    with pytest.raises(ValueError, match=r"Medusa.save\(layout='eagle'\): the layouts are 'medusa', 'vllm'"):
        Medusa(ok).save(tmp_path / "x", layout="eagle")
