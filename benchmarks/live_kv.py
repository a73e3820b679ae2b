"""Attention over live KV only (issue 14 item 1, decision 45): the live-KV pass on and off,
side by side in one run, at contexts 64, 512 and 4096.

For each context c, one random Llama-style target (4 layers, 4 query / 2 KV heads of 64) and a
1-layer draft of the same shape, K = 4, batch 1 by default; the prompt is ``c - new - K - 2``
tokens so that the call's live bound is exactly c. Two compiled generators per context (the
"specfx" backend: passes, then Inductor), ``live_kv=True`` and ``live_kv=False``, each
generate once (compiling the round), and must produce the same tokens. Then:

* round: ``spec.round_fn()()`` after that call (the fixed-shape round does the same work for
  finished rows), the median of ``--iters`` individually timed calls, interleaved on/off;
* attention: one SDPA call at the target's verify shape (``q [B, 4, K+1, 64]``, bool mask) over
  the capacity vs over the live slots, the median of ``--iters * 20`` calls (eager op:
  what the graph's attention reads, without the rest of the round);
* slots: the buffer's capacity (prompt bucket + new + K + 2, a power of two >= 256) and the
  live bound (what the pass lets attention read), and the calls the pass cut per round graph.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/live_kv.py            # ~4 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import specfx
from specfx.engine.timing import call_times

K, NEW = 4, 16


def _model(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=16384,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def _median_call(fn, iters: int) -> float:
    return statistics.median(call_times(fn, iters, warmup=3))


def _attention_ms(batch: int, slots: int, live_prefix: int, iters: int) -> float:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, K + 1, 64, generator=g)
    k, v = torch.randn(batch, 4, slots, 64, generator=g), torch.randn(batch, 4, slots, 64, generator=g)
    pos = live_prefix - K - 2 + torch.arange(K + 1)
    mask = (torch.arange(slots).view(1, 1, 1, -1) <= pos.view(1, 1, -1, 1)).expand(batch, 1, -1, -1)
    with torch.no_grad():
        return 1e3 * _median_call(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), iters)


def run(contexts, batch: int, iters: int, backend: str) -> list[dict]:
    target, draft = _model(4, 0), _model(1, 1)
    rows = []
    for c in contexts:
        prompt = c - NEW - K - 2
        ids = torch.randint(3, 2048, (batch, prompt), generator=torch.Generator().manual_seed(c))
        specs, outs = {}, {}
        for on in (True, False):
            spec = specfx.speculate(target, draft=draft, num_speculative_tokens=K, backend=backend, live_kv=on)
            t0 = time.perf_counter()
            with torch.no_grad():
                outs[on] = spec.generate(ids, max_new_tokens=NEW, do_sample=False)
            specs[on] = (spec, time.perf_counter() - t0)
        if not torch.equal(outs[True], outs[False]):
            raise SystemExit(f"context {c}: live_kv=True and live_kv=False generated different tokens")
        fns = {on: specs[on][0].round_fn() for on in (True, False)}
        times = {True: [], False: []}
        for _ in range(iters):  # interleaved, so load drifts hit both alike
            for on in (True, False):
                times[on].append(_median_call(fns[on], 1))
        spec_on = specs[True][0]
        capacity, live = spec_on.state_slots.shape[1], spec_on.compile_events[-1].key[-1]
        cut = [dict(g.report.sites).get("live_kv", 0) for g in spec_on.graphs]
        row = dict(
            context=c,
            prompt=prompt,
            capacity=capacity,
            live=live,
            cut_calls=cut[-1] if cut else 0,
            round_off_ms=1e3 * statistics.median(times[False]),
            round_on_ms=1e3 * statistics.median(times[True]),
            attn_off_ms=_attention_ms(batch, capacity, live, iters * 20),
            attn_on_ms=_attention_ms(batch, live, live, iters * 20),
        )
        rows.append(row)
        print(_line(row), flush=True)
    return rows


HEADER = (
    "| context | prompt | capacity | live | attention calls cut | attention off (ms) | attention on (ms) | ratio "
    "| round off (ms) | round on (ms) | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _line(r: dict) -> str:
    return (
        f"| {r['context']} | {r['prompt']} | {r['capacity']} | {r['live']} | {r['cut_calls']} "
        f"| {r['attn_off_ms']:.4f} | {r['attn_on_ms']:.4f} | {r['attn_off_ms'] / r['attn_on_ms']:.2f}x "
        f"| {r['round_off_ms']:.2f} | {r['round_on_ms']:.2f} | {r['round_off_ms'] / r['round_on_ms']:.2f}x |"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--backend", default="specfx", choices=("specfx", "specfx_eager"))
    args = p.parse_args(argv)
    if any(c < NEW + K + 3 for c in args.contexts):
        p.error(f"contexts must be >= {NEW + K + 3}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch {args.batch}, K = {K}, {args.backend}")
    print(HEADER, flush=True)
    run(args.contexts, args.batch, args.iters, args.backend)


if __name__ == "__main__":
    main()
