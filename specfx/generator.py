"""``speculate()`` and the generator it returns: the host loop around compiled rounds."""

from __future__ import annotations

import functools
import logging
import time
import types

import torch

from .auto_k import AutoK
from .config import AUTO, SpecConfig
from .drafters import resolve_drafter
from .generate_args import GenerateRequest, resolve_generate_args
from .passes.backend import GraphRecord, make_backend
from .round import RoundState, prefill_step, round_step
from .runner import ModelRunner
from .stats import SpecStats

__all__ = ["SpeculativeGenerator", "speculate"]

logger = logging.getLogger(__name__)


def speculate(
    model, draft=None, *, num_speculative_tokens: int | str = 4, compile: bool = True, backend="specfx", **options
):
    """Wrap an HF causal LM for speculative generation.

    Args:
        model: the target, a transformers causal LM (``AutoModelForCausalLM``). It is used as
            is: no weights are copied and nothing in it is changed.
        draft: the drafter: a smaller causal LM with the same vocabulary, a drafter name
            (``"prompt_lookup"``, ``"name:arg"``; see ``specfx.drafters.NAMED_DRAFTERS``), a
            :class:`specfx.drafters.Drafter`, or None (default): the first available of
            ``specfx.drafters.DEFAULT_DRAFTERS`` (MTP heads when the model has them, otherwise
            prompt lookup). ``spec.method`` names the choice.
        num_speculative_tokens: K, proposals per round, or "auto": K chosen per round from the
            measured acceptance among ``auto_k_values`` (one compiled round graph per value).
        compile: compile each round into one graph (True), or run it eagerly (False).
        backend: torch.compile backend for those graphs ("specfx", "specfx_eager", or any).
        **options: further :class:`SpecConfig` fields (rounds_per_sync, prefill_buckets, ...).

    Returns:
        A :class:`SpeculativeGenerator`, which behaves like ``model`` and whose ``generate()``
        takes ``model.generate()``'s arguments.
    """
    config = SpecConfig(num_speculative_tokens=num_speculative_tokens, compile=compile, backend=backend, **options)
    return SpeculativeGenerator(model, draft, config)


def _own_code(fn):
    """A copy of ``fn`` with its own code object: Dynamo caches compiled graphs per code
    object, so each generator gets a private cache and recompile budget."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class SpeculativeGenerator:
    """A target model plus a drafter, generating speculatively.

    Attribute access, ``config``, ``device``, ``generation_config`` and calling the object are
    forwarded to the target, so it can stand in for the model.
    """

    def __init__(self, model, draft, config: SpecConfig):
        self.target_runner = ModelRunner(model, role="target")
        self.drafter = resolve_drafter(draft, model)
        self.drafter.bind(self.target_runner)
        self.spec_config = config
        self.auto_k = None  # AutoK for num_speculative_tokens="auto"; .history lists the Ks used
        if config.num_speculative_tokens == AUTO:
            cost = config.auto_k_cost
            self.auto_k = AutoK(config.k_values, self.drafter.proposal_cost(self.target_runner) if cost is None else cost)
        self.k = max(config.k_values)  # state buffers fit the largest K
        self.vocab = self.target_runner.vocab_size
        self.state: RoundState | None = None
        self._shape: tuple[int, int] | None = None  # (batch, capacity) of the allocated state
        self._flags: tuple[bool, ...] = ()
        self.graphs: list[GraphRecord] = []
        self._backend = make_backend(config.backend, self.graphs) if isinstance(config.backend, str) else config.backend
        self._prefill_fn = self._maybe_compile(_own_code(SpeculativeGenerator._prefill_impl))
        # one round graph per K (its own code object, so switching K never recompiles)
        self._round_fns = {
            k: functools.partial(self._maybe_compile(_own_code(SpeculativeGenerator._round_impl)), k)
            for k in config.k_values
        }
        self._round_fn = self._round_fns[self.k]
        self.stats = SpecStats()
        self.cumulative_stats = SpecStats()

    # ----------------------------------------------------------------- the wrapped model
    @property
    def model(self):
        return self.target_runner.model

    @property
    def config(self):
        return self.model.config

    @property
    def method(self) -> str:
        """The speculation method in use: the drafter's name ("draft_model", "prompt_lookup",
        "early_exit", "mtp", ...)."""
        return self.drafter.name

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def generation_config(self):
        return self.model.generation_config

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        # Only reached for names this object does not define: forward to the target.
        if name.startswith("__") or name in ("target_runner", "drafter"):
            raise AttributeError(name)
        return getattr(self.target_runner.model, name)

    def __repr__(self) -> str:
        mode = f"compiled ({self.spec_config.backend})" if self.spec_config.compile else "eager"
        k = f"auto{self.spec_config.k_values}" if self.auto_k is not None else self.k
        return f"SpeculativeGenerator(target={type(self.model).__name__}, drafter={self.drafter.name}, K={k}, {mode})"

    # ----------------------------------------------------------------- graphs
    def _maybe_compile(self, fn):
        bound = types.MethodType(fn, self)
        if not self.spec_config.compile:
            return bound
        return torch.compile(bound, backend=self._backend, fullgraph=True, dynamic=False)

    def _prefill_impl(self, ids):
        return prefill_step(self.target_runner, self.drafter, self.state, ids, self._flags, self.vocab)

    def _round_impl(self, k: int):
        return round_step(self.target_runner, self.drafter, self.state, k, self._flags, self.vocab)

    def explain(self) -> str:
        """What was done to the model: the passes applied to each captured graph and its size."""
        lines = [repr(self)]
        if not self.spec_config.compile:
            lines.append("eager mode: rounds run as plain PyTorch; no graph is captured or rewritten.")
        elif not self.graphs:
            lines.append("no graph captured yet: graphs are captured on the first generate() call.")
        for i, g in enumerate(self.graphs):
            lines.append(f"graph {i}: {g.summary()}")
        return "\n".join(lines)

    # ----------------------------------------------------------------- state
    def _ensure_state(self, batch: int, needed: int) -> None:
        cap = self.spec_config.min_capacity
        while cap < needed:
            cap *= 2
        if self._shape is not None and self._shape[0] == batch and self._shape[1] >= needed:
            return
        if self._shape is not None:
            logger.info("specfx: reallocating state for batch %d, capacity %d (graphs will recompile)", batch, cap)
        self.target_runner.allocate(batch, cap)
        self.drafter.allocate(batch, cap)
        self.state = RoundState.allocate(batch, cap, self.vocab, self.k, self.device)
        self._shape = (batch, cap)

    def _load_request(self, req: GenerateRequest) -> None:
        s, sp = self.state, req.sampling
        s.prompt_lengths.copy_(req.prompt_lengths)
        s.gen_end.copy_(req.prompt_lengths + req.max_new_tokens)
        if sp.do_sample:  # HF-style: torch.manual_seed reproduces; greedy leaves the global RNG alone
            s.seed.fill_(int(torch.randint(0, 2**62, (1,))))
        v = s.values
        v["temperature"].fill_(sp.temperature)
        v["top_k"].fill_(sp.top_k)
        v["top_p"].fill_(sp.top_p)
        v["penalty"].fill_(sp.repetition_penalty)
        v["min_new"].fill_(sp.min_new_tokens)
        eos = list(sp.eos_token_ids) or [-1]
        if s.eos_ids.numel() != len(eos):
            s.eos_ids = torch.tensor(eos, dtype=torch.long, device=self.device)
        else:
            s.eos_ids.copy_(torch.tensor(eos, dtype=torch.long))
        self._flags = sp.flags

    # ----------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, inputs=None, **kwargs):
        """Speculative drop-in for ``model.generate()``.

        Takes HF's arguments with HF's defaults from ``model.generation_config``: input_ids
        (or ``inputs``), attention_mask (left padding), max_new_tokens, max_length,
        min_new_tokens, min_length, do_sample, temperature, top_k, top_p, repetition_penalty,
        eos_token_id (int or list), pad_token_id, generation_config, streamer,
        stopping_criteria, max_time, return_dict_in_generate. Returns what HF returns: a
        ``[B, S + new]`` LongTensor, or a ``GenerateDecoderOnlyOutput`` with ``sequences``.
        Arguments it cannot honour raise ``ValueError`` naming the argument.
        """
        tr = self.target_runner
        req = resolve_generate_args(self.model, tr.vocab_size, tr.max_positions, inputs, kwargs)
        batch, seq_len = req.input_ids.shape
        bucket = self.spec_config.bucket(seq_len)
        self._ensure_state(batch, bucket + req.max_new_tokens + self.k + 2)
        self._load_request(req)
        ids = torch.nn.functional.pad(req.input_ids, (bucket - seq_len, 0))  # left-pad to the bucket

        start = time.monotonic()
        first = self._prefill_fn(ids)
        streamer, criteria = req.streamer, req.stopping_criteria
        host_tokens = [[] for _ in range(batch)] if criteria else None
        stop_at = [None] * batch
        if streamer is not None:
            streamer.put(req.input_ids.cpu())
            streamer.put(first.cpu())
        if host_tokens is not None:
            for b, t in enumerate(first.tolist()):
                host_tokens[b].append(t)
            self._apply_criteria(req, host_tokens, stop_at, 0)

        rounds_left = req.max_new_tokens  # every round emits >= 1 token per active row
        auto, k = self.auto_k, self.k
        if auto is not None:
            auto.reset()
        while rounds_left > 0 and not self._sync_finished():
            if auto is not None:
                k = auto.k
                auto.history.append(k)
            round_fn = self._round_fns[k]
            for _ in range(min(self.spec_config.rounds_per_sync, rounds_left)):
                out, n = round_fn()
                rounds_left -= 1
                if streamer is not None or host_tokens is not None:
                    out_h, n_h = out.cpu(), n.tolist()
                    new = [out_h[b, : n_h[b]].tolist() for b in range(batch)]
                    if host_tokens is not None:
                        before = [len(t) for t in host_tokens]
                        for b in range(batch):
                            host_tokens[b].extend(new[b])
                        self._apply_criteria(req, host_tokens, stop_at, before)
                        # a criterion may stop a row mid-round: nothing past it is emitted
                        new = [t if cap is None else t[: max(0, cap - k)] for t, cap, k in zip(new, stop_at, before, strict=False)]
                    if streamer is not None and new[0]:
                        streamer.put(torch.tensor(new[0]))
            if req.max_time is not None and time.monotonic() - start > req.max_time:
                break
        if streamer is not None:
            streamer.end()
        return self._finish(req, stop_at)

    def _sync_finished(self) -> bool:
        """The host's read between rounds: are all rows finished? With "auto" the acceptance
        counters come back in the same transfer and choose the next K."""
        s = self.state
        if self.auto_k is None:
            return bool(s.finished.all())
        counters = [s.finished.all().long(), s.accepted.sum(), s.row_rounds.sum()]
        read = torch.cat([torch.stack(counters), s.per_position])
        done, accepted, row_rounds, *per_position = read.tolist()
        self.auto_k.update(accepted, row_rounds, per_position)
        return bool(done)

    def _apply_criteria(self, req, host_tokens, stop_at, before) -> None:
        """Run the user's stopping criteria token by token (HF semantics: stop right after the
        token that triggers them); the criteria get ``scores=None``."""
        s = self.state
        for b, toks in enumerate(host_tokens):
            if stop_at[b] is not None:
                continue
            start = before if isinstance(before, int) else before[b]
            for j in range(start, len(toks)):
                seq = torch.cat([req.input_ids[b].cpu(), torch.tensor(toks[: j + 1])]).unsqueeze(0)
                done = req.stopping_criteria(seq, None)
                if bool(torch.as_tensor(done).any()):
                    stop_at[b] = j + 1
                    s.finished[b] = True
                    break

    def _finish(self, req: GenerateRequest, stop_at):
        s = self.state
        lengths = s.lengths.cpu()
        prompt = req.prompt_lengths.cpu()
        tokens = s.tokens.cpu()
        counts = (lengths + 1 - prompt).tolist()
        counts = [c if cap is None else min(c, cap) for c, cap in zip(counts, stop_at, strict=False)]
        width = max(counts)
        pad = req.pad_token_id if req.pad_token_id is not None else 0
        new = torch.full((len(counts), width), pad, dtype=torch.long)
        for b, c in enumerate(counts):
            p = int(prompt[b])
            new[b, :c] = tokens[b, p : p + c]
        sequences = torch.cat([req.input_ids, new.to(self.device)], dim=1)
        self._read_stats()
        if req.return_dict_in_generate:
            from .outputs import generate_output  # HF's output classes, imported only when asked for

            return generate_output(self.model, self.target_runner.cache, req, sequences, torch.tensor(counts))
        return sequences

    def _read_stats(self) -> None:
        s = self.state
        stats = SpecStats(
            rounds=int(s.rounds),
            proposed=int(s.proposed.sum()),
            accepted=int(s.accepted.sum()),
            emitted=int(s.emitted.sum()),
            row_rounds=int(s.row_rounds.sum()),
            per_position=s.per_position.tolist(),
            per_row_accepted=s.accepted.tolist(),
            per_row_proposed=s.proposed.tolist(),
        )
        self.stats = stats
        self.cumulative_stats.merge(stats)


