"""How vLLM drafts with a PARD model, restated from its source (facts, not code) so a test can
run a draft saved by specfx the way vLLM runs it. vLLM is not installed here (its kernels do not
run on a CPU); what is restated is the *layout* of the draft's one forward per step and what its
KV cache holds between steps. The draft model itself is an ordinary causal LM, run here by
transformers. Read in the published wheel of vLLM 0.33.0 (``vllm/_version.py``: commit
``g4ba787ec9``; decision 85 of docs/ARCHITECTURE.md):

* **How PARD is selected** (vllm/config/speculative.py): ``method="draft_model"`` (the default
  when a draft model is given and its path does not name another method) with
  ``parallel_drafting=True``, which the user must pass: nothing in the draft's config turns it on
  (``pard_token`` and ``spd_type`` select nothing; without it the draft runs as an ordinary
  autoregressive draft model, K forwards a step). ``num_lookahead_slots``: K new query slots a
  request ("PARD does not shift the existing input"). The draft's vocabulary size must equal the
  target's (``verify_equal_vocab_size_if_draft_model``). Model Runner V2 does not run parallel
  drafting for methods other than dflash/dspark (vllm/config/vllm.py,
  ``_get_v2_model_runner_unsupported_features``), so PARD runs on the V1 runner's
  ``DraftModelProposer`` (vllm/v1/spec_decode/draft_model.py): the draft's own embedding, LM
  head and KV cache (nothing shared with the target).
* **The mask id** (vllm/v1/spec_decode/llm_base_proposer.py ``_init_parallel_drafting_params``):
  ``dflash_config["mask_token_id"]``, else a top-level ``mask_token_id`` that is not None, else
  ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id`` (the first present).
* **One step's input** (``SpecDecodeBaseProposer.set_inputs_first_pass`` with
  ``extra_slots_per_request = K`` and, for a draft model, ``shift_input_ids=False``; the kernel
  ``copy_and_expand_eagle_inputs_kernel`` in vllm/v1/spec_decode/utils.py): per request, the tokens
  the target verified this step up to the last accepted one (the previous bonus token and the
  accepted proposals; after prefill, the prompt), unshifted at their positions; then the bonus
  token (the one the target just sampled); then K - 1 ``parallel_drafting_token_id``; positions
  ``start_pos + j`` throughout (consecutive); the rejected proposals' rows get the padding id,
  position 0 and no KV slot (``compute_new_slot_mapping`` masks them), so they write nothing and
  nothing reads them. One causal forward writes the KV of every fed row at its position's slot
  before attending (the paged cache, slot == position through the block table) and reads the
  request's cache up to each row's position.
* **The proposals** (``token_indices_to_sample``: the bonus row and the K - 1 mask rows;
  ``_sample_draft_tokens``): the draft's logits there, argmax under
  ``draft_sample_method="greedy"`` (the default); with ``"probabilistic"`` a Gumbel sample at
  the request's temperature.

So between steps the cache holds, at the positions after the last accepted token, the previous
step's bonus and mask KV; the next step re-feeds the verified tokens from the previous bonus on,
rewriting every slot that now holds an accepted token before any row reads it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specfx.model.hf_names import cache_kwarg


def parallel_drafting_token_id(config: dict) -> int:
    """vLLM's mask id for parallel drafting from a draft's config.json ``config`` (see above)."""
    if "mask_token_id" in (config.get("dflash_config") or {}):
        return config["dflash_config"]["mask_token_id"]
    if config.get("mask_token_id") is not None:
        return config["mask_token_id"]
    for key in ("dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if key in config:
            return config[key]
    raise AssertionError("vLLM: no token id for parallel drafting")


def step_inputs(verified: list[int], start: int, bonus: int, k: int, mask_id: int, refeed: bool = True):
    """One request's rows of a drafting step: ``(ids, positions, sampled rows)``. ``verified``:
    the tokens the target verified this step up to the last accepted one, from position ``start``.
    ``refeed=False`` leaves them out (not vLLM's layout: the negative control)."""
    fed = verified if refeed else []
    ids = fed + [bonus] + [mask_id] * (k - 1)
    first = start if refeed else start + len(verified)
    positions = list(range(first, first + len(ids)))
    return ids, positions, list(range(len(fed), len(fed) + k))


class VllmPardRequest:
    """One request's drafting on a draft model with a KV cache that persists across steps. A
    step writes a contiguous run of positions; a slot at or past the run's start is overwritten
    by it or lies past every row's position (invisible to causal attention), so cropping the
    cache to the run's start before each step keeps exactly what the paged cache would show.
    Reading below the run's start a slot no step wrote raises."""

    def __init__(self, model, mask_id: int, k: int):
        self.model, self.mask_id, self.k = model, mask_id, k
        self.cache = DynamicCache()

    @torch.no_grad()
    def step(self, verified: list[int], start: int, bonus: int, refeed: bool = True) -> torch.Tensor:
        """The draft logits ``[K, V]`` of one step (see :func:`step_inputs`)."""
        ids, positions, rows = step_inputs(verified, start, bonus, self.k, self.mask_id, refeed)
        held = self.cache.get_seq_length()
        if held < positions[0]:
            raise AssertionError(f"vLLM: a step from position {positions[0]} reads slots never written from {held}")
        if held > positions[0]:  # a negative count removes that many (a positive one meant a length before 5.24)
            self.cache.crop(positions[0] - held)
        pos = torch.tensor([positions])
        cache = {cache_kwarg(self.model): self.cache}  # "cache" on transformers >= 5.24, "past_key_values" before
        out = self.model(
            input_ids=torch.tensor([ids]), position_ids=pos, cache_position=pos[0], use_cache=True, **cache
        )
        return out.logits[0, rows]
