"""SlotCache (specfx.model.cache): each row's new keys and values land in the slots it is given,
the whole buffers are returned, padding goes to the trash slot, one-row forwards write only their
row, and move() copies accepted tree nodes to their committed slots (reads before writes)."""

import torch

from specfx.model.cache import SlotCache

H, D = 2, 3  # KV heads, head dim


def _kv(b: int, t: int, start: float = 1.0):
    """Keys/values ``[b, H, t, D]`` whose every entry is distinct (values = -keys)."""
    k = torch.arange(b * H * t * D, dtype=torch.float32).reshape(b, H, t, D) + start
    return k, -k


def _cache(b=2, capacity=8, layers=1):
    return SlotCache(layers, b, capacity, torch.device("cpu"))


def test_update_scatters_each_row_to_its_slots_and_returns_the_whole_buffers():
    cache = _cache()
    cache.slots = torch.tensor([[0, 1], [3, 7]])  # row 1's second token is padding: the trash slot
    k, v = _kv(2, 2)
    keys, values = cache.layers[0].update(k, v, 0)
    assert keys.shape == (2, H, 8, D) and values.shape == (2, H, 8, D)
    assert keys is cache.layers[0].keys and values is cache.layers[0].values
    for row, slots in enumerate([[0, 1], [3, 7]]):
        for t, slot in enumerate(slots):
            assert torch.equal(keys[row, :, slot], k[row, :, t])
            assert torch.equal(values[row, :, slot], v[row, :, t])
    written = {(0, 0), (0, 1), (1, 3), (1, 7)}
    for row in range(2):
        for slot in range(8):
            if (row, slot) not in written:
                assert not keys[row, :, slot].any() and not values[row, :, slot].any(), (row, slot)


def test_a_later_update_overwrites_a_rejected_slot_in_place():
    cache = _cache(b=1)
    cache.slots = torch.tensor([[2, 3, 4]])
    cache.layers[0].update(*_kv(1, 3), 0)
    buffer = cache.layers[0].keys
    cache.slots = torch.tensor([[3]])  # slot 3's proposal was rejected; the next token goes there
    new_k, new_v = _kv(1, 1, start=100.0)
    cache.layers[0].update(new_k, new_v, 0)
    assert cache.layers[0].keys is buffer  # static: never reallocated
    assert torch.equal(buffer[0, :, 3], new_k[0, :, 0])
    assert torch.equal(cache.layers[0].values[0, :, 3], new_v[0, :, 0])
    assert torch.equal(buffer[0, :, 2], _kv(1, 3)[0][0, :, 0])  # the others stay


def test_a_one_row_forward_writes_only_its_row_and_sees_only_it():
    cache = _cache()
    cache.slots = torch.tensor([[0, 1], [0, 1]])
    cache.layers[0].update(*_kv(2, 2), 0)  # allocate with both rows
    before = cache.layers[0].keys.clone()
    cache.row = 1
    cache.slots = torch.tensor([[5]])
    k, v = _kv(1, 1, start=50.0)
    keys, values = cache.layers[0].update(k, v, 0)
    assert keys.shape == (1, H, 8, D) and values.shape == (1, H, 8, D)
    assert torch.equal(keys[0, :, 5], k[0, :, 0])
    assert torch.equal(cache.layers[0].keys[0], before[0])  # row 0 untouched
    assert torch.equal(cache.layers[0].keys[1, :, 5], k[0, :, 0])


def test_move_copies_slots_per_row_reading_before_writing():
    cache = _cache(layers=2)
    cache.slots = torch.tensor([[3, 4, 5], [3, 4, 5]])
    for layer in cache.layers:
        layer.update(*_kv(2, 3), 0)
    old = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    # row 0: slots 4, 5 -> 3, 4 (overlapping); row 1: slot 5 -> 3 and 3 -> 5 (a swap)
    cache.move(torch.tensor([[4, 5], [5, 3]]), torch.tensor([[3, 4], [3, 5]]))
    for layer, (keys, values) in zip(cache.layers, old, strict=True):
        for buf, ref in ((layer.keys, keys), (layer.values, values)):
            assert torch.equal(buf[0, :, 3], ref[0, :, 4]) and torch.equal(buf[0, :, 4], ref[0, :, 5])
            assert torch.equal(buf[1, :, 3], ref[1, :, 5]) and torch.equal(buf[1, :, 5], ref[1, :, 3])
            assert torch.equal(buf[1, :, 4], ref[1, :, 4])


def test_move_skips_layers_never_written():
    cache = _cache(layers=2)
    cache.slots = torch.tensor([[0], [0]])
    cache.layers[0].update(*_kv(2, 1), 0)
    cache.move(torch.tensor([[0], [0]]), torch.tensor([[1], [1]]))
    assert not cache.layers[1].is_initialized
    assert torch.equal(cache.layers[0].keys[:, :, 1], cache.layers[0].keys[:, :, 0])


def test_sizes_the_model_reads():
    cache = _cache(capacity=16)
    assert cache.trash_slot == 15
    assert cache.layers[0].get_mask_sizes(4) == (16, 0) and cache.layers[0].get_max_length() == 16
    assert cache.nbytes == 0  # nothing allocated before the first forward
    cache.slots = torch.tensor([[0], [0]])
    cache.layers[0].update(*_kv(2, 1), 0)
    assert cache.nbytes == 2 * (2 * H * 16 * D) * 4  # keys and values, float32


def test_indexer_keys_are_written_at_slots_moved_and_counted():
    """A sparse-attention indexer's keys (HF's ``Cache.update_indexer``, decision 94): one
    ``[B, T, Di]`` key per token, at the token's slot, the whole ``[B, C, Di]`` buffer returned;
    a one-row forward writes and sees its row; ``move`` and ``nbytes`` include them."""
    cache = _cache(layers=2)
    cache.slots = torch.tensor([[0, 1], [3, 7]])
    cache.layers[0].update(*_kv(2, 2), 0)
    new = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 4) + 1
    got = cache.update_indexer(new, 0)
    assert got is cache.layers[0].indexer_keys and got.shape == (2, 8, 4)
    assert torch.equal(got[0, :2], new[0]) and torch.equal(got[1, 3], new[1, 0]) and torch.equal(got[1, 7], new[1, 1])
    assert int((got != 0).any(-1).sum()) == 4  # nothing else written
    assert cache.layers[1].indexer_keys is None  # a layer without an indexer keeps none
    assert cache.nbytes == 2 * (2 * H * 8 * D) * 4 + 2 * 8 * 4 * 4
    cache.row, cache.slots = 1, torch.tensor([[5]])
    one = torch.full((1, 1, 4), 9.0)
    seen = cache.update_indexer(one, 0)
    assert seen.shape == (1, 8, 4) and torch.equal(seen[0, 5], one[0, 0]) and not got[0, 5].any()
    cache.row = None
    before = got.clone()
    cache.move(torch.tensor([[1], [7]]), torch.tensor([[2], [4]]))
    assert torch.equal(got[0, 2], before[0, 1]) and torch.equal(got[1, 4], before[1, 7])
