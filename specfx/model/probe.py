"""The incremental-decoding probe's measurements: a model is speculated only if specfx's path
reproduces it (:mod:`specfx.model.admission` runs them and words the refusals).

specfx drives a model through hooks (a :class:`~specfx.model.cache.SlotCache` as
its cache argument, an explicit mask, ``position_ids``). A model that ignores one of them
(bidirectional heads, positions taken from the cache length, a local-attention window built
from the cache's key length as GPT-Neo does) would silently generate other tokens. So before a
model is used, and again whenever its buffers grow past every capacity checked so far, the
probe compares the model's own full forward (no cache) with specfx's incremental path, run
the way the generator runs it:

* at the real buffer capacity (the generator's ``min_capacity`` times a power of two);
* over a sequence that crosses every attention span the config declares (sliding windows,
  attention chunks, GPT-Neo's ``window_size``...), the small chunks straddling the largest;
* as a batch of two rows, the second left-padded (padding at position 0 and the trash slot);
* a prefill chunk, then verify-like chunks of 1..5 tokens whose rejected proposals leave
  stale keys in later slots that the next chunk overwrites (:data:`TAIL`);
* for a model with recurrent state, the same chunks each rolled back to its accepted inputs, one
  of them rejected entirely (:data:`STATE_TAIL`), and the state at the end compared with the
  model's own (:func:`compare_states`). The reference is then the model's own decoding, as HF's
  ``generate()`` runs it (:func:`own_decoding`: a forward over the prefill, then one token at a time),
  not its full forward: a recurrent model's multi-token and single-token paths may differ (decision 90).

The comparison is strict (:func:`compare`): every logit within a dtype-aware tolerance and
the same argmax at every position (up to near-ties within that tolerance).
"""

from __future__ import annotations

import inspect
import re

import torch

from specfx.model.hf_names import cache_kwarg, output_cache

__all__ = [
    "PROBE_MIN_CAPACITY",
    "REL_TOL",
    "STATE_TAIL",
    "TAIL",
    "attention_spans",
    "compare",
    "compare_states",
    "decodes_incrementally",
    "full_logits",
    "incremental_logits",
    "own_decoding",
    "not_causal",
    "probe_capacity",
    "probe_length",
    "probe_tokens",
    "tree_logits",
]

# The generator's first capacity (SpecConfig.min_capacity's default); buffers grow by doubling,
# so probing at this times a power of two probes a capacity the generator really allocates.
PROBE_MIN_CAPACITY = 256

# Verify-like chunks after the prefill: (tokens written, tokens accepted). The rest of each
# chunk is a rejected proposal: garbage keys the mask must hide until the next chunk
# overwrites them, as after a partly rejected round. 12 accepted tokens in all.
TAIL = ((1, 1), (4, 2), (3, 3), (5, 1), (2, 2), (3, 3))
TAIL_TOKENS = sum(a for _, a in TAIL)
# A model with recurrent state (decision 76) also gets a chunk whose every input is rejected
# (n = 0: its state must come back to the snapshot alone), before the last chunk, which reads it.
STATE_TAIL = TAIL[:-1] + ((3, 0),) + TAIL[-1:]
MIN_PROBE_TOKENS = 40  # crosses the tiny configs' windows of 8 several times
PAD = 3  # left padding of the probe's second row

# Tolerance on |logit difference|, relative to the largest |logit| of the reference.
# float32: a correct incremental path differs from the full forward only by summation order
# (chunked attention, other matmul shapes): ~1e-6 relative on the tiny models, ~1e-5 on
# deep ones; 1e-4 leaves a margin, while a wrong window, mask or position moves logits by a
# sizeable fraction of their scale. Half precision rounds every activation to the dtype, so
# two correct paths differ by a few ulps of the largest logit: 8 ulps (8 * eps).
REL_TOL = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.bfloat16: 8 * torch.finfo(torch.bfloat16).eps,  # 0.0625
    torch.float16: 8 * torch.finfo(torch.float16).eps,  # 0.0078
}

# Config attributes that declare an attention span (sliding_window, window_size,
# attention_chunk_size, local_attention_window_len, sliding_window_size...).
_SPAN_NAME = re.compile(r"(window|window_size|window_len|window_length|chunk_size|chunk_length)$")


def attention_spans(config, mask_plan) -> list[int]:
    """Every window or chunk size the model may apply: the mask plan's (what specfx builds)
    and any positive int config attribute named like one (what the model may build itself)."""
    spans = set()
    for pattern in [mask_plan.single] if mask_plan.by_type is None else list(mask_plan.by_type.values()):
        if pattern[1] is not None:
            spans.add(pattern[1])
    for name, value in config.to_dict().items():
        if _SPAN_NAME.search(name) and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            spans.add(value)
    return sorted(spans)


def probe_length(config, mask_plan, max_positions: int | None) -> int:
    """Tokens in the probe: past the largest span by 8, so the verify-like tail (the last
    :data:`TAIL_TOKENS`) straddles it; at least :data:`MIN_PROBE_TOKENS`; within the model's
    positions (a span no position can cross needs no crossing)."""
    spans = attention_spans(config, mask_plan)
    length = max([MIN_PROBE_TOKENS] + [s + 8 for s in spans])
    if max_positions is not None:
        length = min(length, max_positions)
    return max(length, TAIL_TOKENS + PAD + 1)


def probe_capacity(length: int) -> int:
    """The smallest capacity the generator allocates (256 times a power of two) that holds
    ``length`` tokens plus the trash slot."""
    cap = PROBE_MIN_CAPACITY
    while cap < length + 1:
        cap *= 2
    return cap


def probe_tokens(length: int, vocab: int, device) -> torch.Tensor:
    """A fixed pseudo-random sequence ``[length]`` (ids 3.. avoid pad/bos/eos)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(min(3, vocab - 1), vocab, (length,), generator=g).to(device)


def full_logits(model, seq: torch.Tensor) -> torch.Tensor:
    """The model's own forward, no cache: ``seq [L]`` -> float logits ``[L, V]``."""
    pos = torch.arange(seq.numel(), device=seq.device).unsqueeze(0)
    kwargs = {"position_ids": pos} if "position_ids" in inspect.signature(model.forward).parameters else {}
    return model(input_ids=seq.unsqueeze(0), use_cache=False, **kwargs).logits[0].float()


def not_causal(model, seq: torch.Tensor, full: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What differs when ``model``'s full forward sees only the first half of ``seq [L]`` instead
    of all of it (``full``: :func:`full_logits` of ``seq``), or None: a causal forward gives the
    same logits for a prefix either way. Asked after the probe failed, to name the cause: a
    forward that attends to later tokens cannot be reproduced by any incremental decoding."""
    n = seq.numel() // 2
    found = compare_rows(full_logits(model, seq[:n]), full[:n], dtype)
    return None if found is None else f"its logits for the first {n} tokens change when later tokens follow: {found}"


def incremental_logits(runner, seq: torch.Tensor) -> torch.Tensor:
    """specfx's path through ``runner`` (its cache already allocated for 2 rows): row 0 decodes
    ``seq [L]``, row 1 its first ``L - PAD`` tokens left-padded by PAD. Returns the float logits
    of every committed position, row 0's then row 1's: ``[2L - PAD, V]``."""
    length, vocab, trash = seq.numel(), runner.vocab_size, runner.cache.trash_slot
    offset = torch.tensor([[0], [PAD]], device=seq.device)  # [2, 1] left padding per row
    prefill = length - TAIL_TOKENS
    pos = torch.arange(prefill, device=seq.device) - offset  # [2, P], negative on padding
    real = pos >= 0
    ids = torch.where(real, seq[pos.clamp_min(0)], 0)
    out = runner.forward(ids, pos.clamp_min(0), torch.where(real, pos, trash))
    rows = [[out[0]], [out[1, PAD:]]]
    start = prefill
    stateful = getattr(runner, "stateful", False)
    for size, accepted in STATE_TAIL if stateful else TAIL:
        col = torch.arange(size, device=seq.device)
        pos = start + col - offset  # [2, size]
        ids = torch.where(col < accepted, seq[pos], (seq[pos] + 1) % vocab)  # rejected: other tokens
        if stateful:  # recurrent state: rolled back to the accepted inputs
            out = runner.verify_recording(ids, pos, pos)
            runner.roll_back_state(torch.full((2,), accepted, device=seq.device), size)
        else:
            out = runner.forward(ids, pos, pos)
        for r in range(2):
            rows[r].append(out[r, :accepted])
        start += accepted
    return torch.cat([torch.cat(r) for r in rows]).float()


def own_decoding(model, seq: torch.Tensor, cache_name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's own decoding of the probe's two rows, as HF's ``generate()`` runs it: a forward
    over the row's prefill (what :func:`incremental_logits` prefills), then one token at a time
    through the model's own cache. Returns the float logits ``[2L - PAD, V]`` (row 0's, then row
    1's: ``seq[:L - PAD]``) and the state at the end: every conv and recurrent tensor of its stateful layers, in
    :class:`~specfx.model.recurrent.StateSnapshot`'s order, each ``[2, ...]``."""
    from specfx.model.recurrent import StateSnapshot

    logits, states = [], []
    prefill = seq.numel() - TAIL_TOKENS
    for part, start in ((seq, prefill), (seq[: seq.numel() - PAD], prefill - PAD)):
        pos = torch.arange(part.numel(), device=seq.device).unsqueeze(0)
        out = model(input_ids=part[None, :start], position_ids=pos[:, :start], use_cache=True)
        rows = [out.logits[0]]
        for t in range(start, part.numel()):
            cache = getattr(out, cache_name)
            out = model(
                input_ids=part[None, t : t + 1], position_ids=pos[:, t : t + 1], use_cache=True, **{cache_name: cache}
            )
            rows.append(out.logits[0])
        logits.append(torch.cat(rows))
        states.append([t for _, _, t in StateSnapshot(getattr(out, cache_name)).tensors])
    return torch.cat(logits).float(), [torch.cat(pair) for pair in zip(*states, strict=True)]


def compare_states(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> str | None:
    """None if every state tensor ``got`` (specfx's, after :func:`incremental_logits`) is within
    ``REL_TOL[dtype]`` of the largest ``|ref|`` of its tensor (:func:`own_decoding`), row by row;
    else what differs. Logits see the last chunk's rollback only through later positions, of which
    the probe has none: the state itself is compared."""
    if len(got) != len(ref):
        return f"{len(got)} state tensors where the model's own cache has {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        tol = REL_TOL.get(dtype, 8 * torch.finfo(dtype).eps) * float(r.abs().amax().clamp_min(1e-6))
        diff = (g.float() - r.float()).abs().flatten(1).amax(dim=1)  # [2]
        if not bool((diff <= tol).all()):
            row = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
            return (
                f"state tensor {i} (of {len(ref)}) after the verify-like chunks differs from the model's own state "
                f"by {float(diff[row]):.3g} in row {row} (tolerance {tol:.3g} for {dtype})"
            )
    return None


# The tree probe's nodes after the pending token (seq[P]): a decoy first child, then the true
# token as the second child (slot L + 2 at position L + 1) with the true next token under it
# (slot L + 3 at position L + 2). Verified columns: the root, node 2 and node 3.
TREE_PROBE = ((0,), (1,), (1, 0))
TREE_PROBE_CHECKED = (0, 2, 3)


def tree_logits(runner, seq: torch.Tensor) -> torch.Tensor:
    """specfx's token-tree verification through ``runner`` (its cache allocated for 1 row):
    prefill ``seq[:P]`` (P = L - 3), then one tree forward over the pending token ``seq[P]``
    and :data:`TREE_PROBE`, where slots and positions differ. Returns the float logits ``[3,
    V]`` of the root and the two true nodes, which must equal the full forward's at positions
    P, P + 1, P + 2: a model that derives positions or biases from slot indices (MPT's ALiBi)
    fails here though it decodes chains exactly."""
    from specfx.model.masks import TreeView
    from specfx.trees.types import TokenTree

    length, vocab = seq.numel(), runner.vocab_size
    p = length - 3
    pos = torch.arange(p, device=seq.device).unsqueeze(0)
    runner.forward(seq[:p].unsqueeze(0), pos, pos)
    tree = TokenTree(TREE_PROBE).tensors(seq.device)
    ids = torch.stack([seq[p], (seq[p + 1] + 1) % vocab, seq[p + 1], seq[p + 2]]).unsqueeze(0)  # [1, 4]
    positions = p + tree.depth  # [1, 4]
    slots = p + torch.arange(4, device=seq.device).unsqueeze(0)
    view = TreeView(torch.tensor([p], device=seq.device), tree.depth, tree.ancestors, (0, 1, 2, 3))
    out = runner.forward(ids, positions, slots, tree=view)
    return out[0, list(TREE_PROBE_CHECKED)].float()


def _mismatch(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    """None if ``got [N, V]`` reproduces ``ref [N, V]``: every logit within ``REL_TOL[dtype] *
    max|ref|`` and, at every position, got's argmax a top token of the reference (within the
    same tolerance: near-ties may flip). Else ``(worst position, what differs in words)``."""
    tol = REL_TOL.get(dtype, 8 * torch.finfo(dtype).eps) * float(ref.abs().amax().clamp_min(1.0))
    diff = (got - ref).abs().amax(dim=-1)  # [N]
    bad = ~(diff <= tol)  # NaN counts as bad
    chosen = ref.gather(-1, got.argmax(dim=-1, keepdim=True)).squeeze(-1)
    flipped = ~(chosen >= ref.amax(dim=-1) - tol)
    if not (bad.any() or flipped.any()):
        return None
    worst = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
    return worst, (
        f"max |logit difference| {float(diff[worst]):.3g} at {{where}} (tolerance {tol:.3g} for {dtype}); "
        f"{int(bad.sum())} of {diff.numel()} positions over it, argmax different at {int(flipped.sum())}"
    )


def compare_rows(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None if ``got [N, V]`` reproduces ``ref [N, V]`` (:func:`compare`'s rule), else what differs."""
    found = _mismatch(got, ref, dtype)
    return None if found is None else found[1].format(where=f"checked position {found[0]}")


def compare(got: torch.Tensor, full: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None if ``got`` (:func:`incremental_logits`' ``[2L - PAD, V]``) reproduces ``full``
    (:func:`full_logits`' ``[L, V]``, or both rows' own references ``[2L - PAD, V]``:
    :func:`own_decoding`'s): every logit within ``REL_TOL[dtype] * max|full|`` and,
    at every position, got's argmax a top token of the reference (within the same tolerance:
    near-ties may flip). Else what differs, in words."""
    length = (got.shape[0] + PAD) // 2
    ref = full if full.shape[0] == got.shape[0] else torch.cat([full, full[: length - PAD]])  # row 1: a prefix
    found = _mismatch(got, ref, dtype)
    if found is None:
        return None
    worst, what = found
    row, position = (0, worst) if worst < length else (1, worst - length)
    return what.format(where=f"position {position} of row {row}")


def decodes_incrementally(model, length: int = 12) -> bool:
    """Whether ``model``'s own incremental decoding, one token at a time through its own cache as
    HF's ``generate()`` runs it, gives the logits of its full forward over the same ``length``
    tokens (within the probe's tolerance). False for a forward that attends to later tokens (an
    encoder head, or a decoder whose installed implementation builds a bidirectional mask): no
    incremental path, HF's nor specfx's, reproduces such a model. Only HF's hooks are used here;
    specfx's own path is the probe's business (the rest of this module)."""
    seq = probe_tokens(length, model.config.get_text_config().vocab_size, model.device)
    name = cache_kwarg(model)
    cache, steps = None, []
    with torch.no_grad():
        full = full_logits(model, seq)  # [L, V]
        for t in range(length):
            out = model(input_ids=seq[t : t + 1].unsqueeze(0), use_cache=True, **({name: cache} if t else {}))
            cache = output_cache(out)
            steps.append(out.logits[0, -1].float())
    return compare_rows(torch.stack(steps), full, model.dtype) is None
