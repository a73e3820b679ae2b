"""ModelRunner.forward (specfx.model.runner), eager, on a tiny model: a prefill then decode steps
through the static SlotCache give HF's own forward logits; KV lands at the slots given, padding
in the trash slot, and the positions (not the slots) are what the model sees."""

import pytest
import torch

from specfx.model.hf_names import output_cache
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm

ATOL = 1e-4  # float32: the two paths differ only by summation order


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama")


@pytest.fixture(scope="module")
def seq():
    return torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(0))  # [L]


def _hf(model, seq: torch.Tensor):
    """HF's own forward over ``seq [L]``: logits ``[L, V]`` and its DynamicCache."""
    with torch.no_grad():
        out = model(input_ids=seq.unsqueeze(0), use_cache=True)
    return out.logits[0], output_cache(out)


def _runner(model, batch_size: int = 1, capacity: int = 32) -> ModelRunner:
    runner = ModelRunner(model, "target")
    runner.allocate(batch_size, capacity)
    return runner


def test_prefill_then_decode_steps_equal_hf_forward(model, seq):
    full, _ = _hf(model, seq)
    runner = _runner(model)
    p = 8
    pos = torch.arange(p).unsqueeze(0)  # [1, P]
    with torch.no_grad():
        prefill = runner.forward(seq[:p].unsqueeze(0), pos, pos)  # slot == position
        assert prefill.shape == (1, p, full.shape[-1])
        torch.testing.assert_close(prefill[0], full[:p], atol=ATOL, rtol=0)
        for t in range(p, seq.numel()):
            step = runner.forward(seq[t : t + 1].view(1, 1), torch.tensor([[t]]), torch.tensor([[t]]))
            assert step.shape == (1, 1, full.shape[-1])
            torch.testing.assert_close(step[0, 0], full[t], atol=ATOL, rtol=0)


def test_kv_is_written_at_the_slots_given(model, seq):
    _, hf_cache = _hf(model, seq)
    runner = _runner(model)
    n = seq.numel()
    pos = torch.arange(n).unsqueeze(0)
    with torch.no_grad():
        runner.forward(seq.unsqueeze(0), pos, pos)
    trash = runner.cache.trash_slot
    for layer, ref in zip(runner.cache.layers, hf_cache.layers, strict=False):
        torch.testing.assert_close(layer.keys[:, :, :n], ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values[:, :, :n], ref.values, atol=ATOL, rtol=0)
        assert not layer.keys[:, :, n:trash].any() and not layer.values[:, :, n:trash].any()


def test_last_only_returns_the_last_column(model, seq):
    full, _ = _hf(model, seq)
    runner = _runner(model)
    pos = torch.arange(seq.numel()).unsqueeze(0)
    with torch.no_grad():
        last = runner.forward(seq.unsqueeze(0), pos, pos, last_only=True)
    assert last.shape == (1, 1, full.shape[-1])
    torch.testing.assert_close(last[0, 0], full[-1], atol=ATOL, rtol=0)


def test_left_padding_goes_to_the_trash_slot_and_rows_are_independent(model, seq):
    full, _ = _hf(model, seq)
    short, _ = _hf(model, seq[:-3])
    runner = _runner(model, batch_size=2)
    n, pad = seq.numel(), 3
    trash = runner.cache.trash_slot
    ids = torch.stack([seq, torch.cat([torch.full((pad,), 7), seq[:-pad]])])  # [2, L]; pad id 7 (id 0 embeds to 0)
    pos = torch.stack([torch.arange(n), (torch.arange(n) - pad).clamp_min(0)])  # padding at position 0
    slots = torch.stack([torch.arange(n), torch.where(torch.arange(n) < pad, trash, torch.arange(n) - pad)])
    with torch.no_grad():
        out = runner.forward(ids, pos, slots)  # [2, L, V]
    torch.testing.assert_close(out[0], full, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, pad:], short, atol=ATOL, rtol=0)
    keys = runner.cache.layers[0].keys  # [2, H, C, D]
    assert keys[1, :, : n - pad].any(dim=-1).all()  # row 1's real tokens at slots 0..L-pad-1
    assert not keys[1, :, n - pad : trash].any()  # and nothing after them
    assert keys[1, :, trash].any()  # the padding went to the trash slot


def test_a_rejected_proposal_is_overwritten_and_hidden(model, seq):
    """Garbage written at slots past the committed prefix (a rejected proposal) changes nothing
    once the next tokens are written at those slots: the mask follows positions."""
    full, _ = _hf(model, seq)
    runner = _runner(model)
    p = 8
    pos = torch.arange(p).unsqueeze(0)
    with torch.no_grad():
        runner.forward(seq[:p].unsqueeze(0), pos, pos)
        wrong = ((seq[p : p + 3] + 1) % 128).unsqueeze(0)
        runner.forward(wrong, torch.arange(p, p + 3).unsqueeze(0), torch.arange(p, p + 3).unsqueeze(0))
        # only the first token is accepted next: position p at slot p; slots p+1, p+2 stay stale
        out = runner.forward(seq[p : p + 1].view(1, 1), torch.tensor([[p]]), torch.tensor([[p]]))
    torch.testing.assert_close(out[0, 0], full[p], atol=ATOL, rtol=0)


def test_positions_decide_what_the_model_sees(model, seq):
    """The same token at the same slot with another position gives other logits (the positions
    given are used, not derived from the slot or the cache length)."""
    runner = _runner(model)
    p = 8
    pos = torch.arange(p).unsqueeze(0)
    with torch.no_grad():
        runner.forward(seq[:p].unsqueeze(0), pos, pos)
        at_p = runner.forward(seq[p : p + 1].view(1, 1), torch.tensor([[p]]), torch.tensor([[p]]))
        at_3 = runner.forward(seq[p : p + 1].view(1, 1), torch.tensor([[3]]), torch.tensor([[p]]))
    assert not torch.allclose(at_p, at_3, atol=1e-3)
