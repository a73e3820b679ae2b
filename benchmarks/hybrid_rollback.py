"""Issue 29's rollback candidates, measured and checked on a GDN model (qwen3_next) and a Mamba2
model, tiny and medium (8 layers, hidden 512), with specfx.model.recurrent (decision 76).

A round verifies T = K+1 inputs from the state S0 left by the previous round and accepts n of K;
the state must become S(n+1), the state after exactly the first n+1 inputs. Candidates:

* ``replay_model``: snapshot S0, verify, restore S0, run the whole model again on the n+1 inputs
  (one forward of a length known only after acceptance: a graph per length, or a host read);
* ``replay_mixers``: as above, but re-run only the stateful mixer modules on their recorded inputs
  (the verify forward's own, position <= n: the same values a replay would compute, since the
  model is causal); attention, MLPs and the LM head are not re-run;
* ``mixer_steps``: ``replay_mixers`` with fixed shapes and per-row n: K+1 single-position mixer
  calls, a predicated write per step (no host sync, no per-length graph);
* ``steps``: verify as K+1 single-token forwards, the state kept after each (per-position states
  with HF's own single-step path), then select position n.

Exactness: the state after rollback against the state after feeding exactly the n+1 inputs
(prefill, then one forward of n+1 tokens), max |diff| / max |ref| over every state tensor, and the
next token's logits after one more input. Timing: medians of ``--repeats`` runs, batch 1, one
thread; the command, thread count and load average are printed with the table.

Run: ``PYTHONPATH=. python benchmarks/hybrid_rollback.py [--sizes tiny medium] [--k 4]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings

import torch

from specfx.bench.harness import median_seconds
from specfx.model.recurrent import (
    MixerTaps,
    StateSnapshot,
    conv_state_after,
    masks_with_state,
    slot_cache_with_state,
    stateful_layers,
)

MODELS = {
    ("qwen3_next", "tiny"): dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    ("qwen3_next", "medium"): dict(
        num_layers=8,
        vocab_size=4096,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        hidden_size=512,
        intermediate_size=1408,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        initializer_range=0.02,
    ),
    ("mamba2", "tiny"): dict(num_heads=8, head_dim=16, state_size=16, n_groups=1),
    ("mamba2", "medium"): dict(
        num_layers=8,
        vocab_size=4096,
        hidden_size=512,
        num_heads=16,
        head_dim=64,
        state_size=64,
        n_groups=1,
        initializer_range=0.02,
    ),
}


def build(arch: str, size: str):
    from specfx.testing.tiny import tiny_causal_lm

    kw = dict(MODELS[(arch, size)])
    return tiny_causal_lm(arch, num_layers=kw.pop("num_layers", 2), vocab_size=kw.pop("vocab_size", 128), **kw)


def fwd(model, ids, cache):
    return model(input_ids=ids, cache=cache, use_cache=True)


def prefill(model, ids):
    return model(input_ids=ids, use_cache=True).cache


def crop_kv(cache, length: int) -> None:
    """Cut the attention layers' KV (HF's DynamicLayer, which appends) to ``length`` tokens: the
    stand-in, in this check, for specfx's static KV whose mask hides rejected entries."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def states(cache) -> list[torch.Tensor]:
    return [t.clone() for _, _, t in StateSnapshot(cache).tensors]


def state_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b, strict=True))


def rollback(method: str, model, prompt, verify, n: int, k: int):
    """The cache after a round from ``prompt``'s state that verifies ``verify [1, K+1]`` and
    accepts n, rolled back by ``method``; and the verify forward's logits."""
    cache = prefill(model, prompt)
    if method == "steps":
        snaps = []
        for t in range(k + 1):
            logits = fwd(model, verify[:, t : t + 1], cache).logits
            snaps.append(StateSnapshot(cache))
        snaps[n].restore()
        crop_kv(cache, prompt.shape[1] + n + 1)
        return cache, logits
    snap = StateSnapshot(cache)
    taps = MixerTaps(model, cache)
    with taps.recording():
        logits = fwd(model, verify, cache).logits
    snap.restore()
    crop_kv(cache, prompt.shape[1] + (0 if method == "replay_model" else n + 1))
    if method == "replay_model":
        fwd(model, verify[:, : n + 1], cache)
    elif method == "replay_mixers":
        taps.replay(cache, n + 1)
    elif method == "mixer_steps":
        taps.replay_steps(cache, torch.tensor([n]), k + 1)
    return cache, logits


def check(model, k: int, seed: int = 0) -> dict:
    """Max relative state error and next-token logit error per method over n = 0..K."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, 12), generator=g)
    verify = torch.randint(3, vocab, (1, k + 1), generator=g)
    nxt = torch.randint(3, vocab, (1, 1), generator=g)
    out = {}
    with torch.no_grad():
        for method in ("replay_model", "replay_mixers", "mixer_steps", "steps"):
            worst_state = worst_logit = 0.0
            for n in range(k + 1):
                ref = prefill(model, prompt)
                fwd(model, verify[:, : n + 1], ref)
                ref_states = states(ref)
                ref_logits = fwd(model, nxt, ref).logits
                cache, _ = rollback(method, model, prompt, verify, n, k)
                worst_state = max(worst_state, state_err(states(cache), ref_states))
                logits = fwd(model, nxt, cache).logits
                worst_logit = max(worst_logit, float((logits - ref_logits).abs().max() / ref_logits.abs().max()))
            out[method] = (worst_state, worst_logit)
    return out


def check_conv(model, k: int, seed: int = 0) -> float:
    """conv_state_after on the inputs the model hands update_conv_state, against the conv state
    after exactly n+1 inputs: worst relative error over layers and n."""
    from transformers.cache_utils import DynamicCache

    class Recording(DynamicCache):  # records what the model hands the HF API; changes nothing
        def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kw):
            self.inputs[layer_idx] = conv_states.clone()
            return super().update_conv_state(conv_states, layer_idx, state_idx, **kw)

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, 12), generator=g)
    verify = torch.randint(3, vocab, (1, k + 1), generator=g)
    worst = 0.0
    with torch.no_grad():
        cache = Recording(config=model.config)
        cache.inputs = {}
        fwd(model, prompt, cache)
        old = {i: layer.conv_states[0].clone() for i, layer in stateful_layers(cache)}
        cache.inputs = {}
        fwd(model, verify, cache)
        new = dict(cache.inputs)
        for n in range(k + 1):
            ref = prefill(model, prompt)
            fwd(model, verify[:, : n + 1], ref)
            for i, layer in stateful_layers(ref):
                got = conv_state_after(old[i], new[i], torch.tensor([n]))
                want = layer.conv_states[0]
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst




def timings(model, k: int, repeats: int) -> dict:
    """Milliseconds: decode step, verify, snapshot/restore, and each rollback's extra work
    (averaged over n = 0..K)."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, 64), generator=g)
    verify = torch.randint(3, vocab, (1, k + 1), generator=g)
    ms = {}
    with torch.no_grad():
        cache = prefill(model, prompt)
        snap = StateSnapshot(cache)

        def run(ids):
            fwd(model, ids, cache)
            snap.restore()
            crop_kv(cache, prompt.shape[1])

        restore_t = median_seconds(snap.restore, repeats)
        ms["decode"] = median_seconds(lambda: run(verify[:, :1]), repeats) - restore_t
        ms["verify"] = median_seconds(lambda: run(verify), repeats) - restore_t
        ms["snapshot"] = median_seconds(lambda: StateSnapshot(cache), repeats)
        ms["restore"] = restore_t
        ms["replay_model"] = statistics.mean(
            median_seconds(lambda n=n: run(verify[:, : n + 1]), repeats) - restore_t for n in range(k + 1)
        )
        taps = MixerTaps(model, cache)
        with taps.recording():
            fwd(model, verify, cache)
        snap.restore()
        crop_kv(cache, prompt.shape[1])

        def mixers(n):
            taps.replay(cache, n + 1)
            snap.restore()

        ms["replay_mixers"] = (
            statistics.mean(median_seconds(lambda n=n: mixers(n), repeats) for n in range(k + 1)) - restore_t
        )

        def mixer_steps():
            taps.replay_steps(cache, torch.tensor([k // 2]), k + 1)
            snap.restore()

        ms["mixer_steps"] = median_seconds(mixer_steps, repeats) - restore_t

        def steps():
            for t in range(k + 1):
                fwd(model, verify[:, t : t + 1], cache)
                StateSnapshot(cache)
            snap.restore()
            crop_kv(cache, prompt.shape[1])

        ms["steps"] = median_seconds(steps, repeats) - restore_t
        ms["state_bytes"] = snap.nbytes
    return {key: (v * 1e3 if key != "state_bytes" else v) for key, v in ms.items()}


def gdn_kernels(k: int, repeats: int) -> dict:
    """One GDN layer of the medium config (8 value heads of 64, 4 key heads), T = K+1: HF's chunked
    kernel (the verify forward's) against its per-token kernel called once per position, keeping
    every position's state (what a per-position verify would run). Milliseconds; and the relative
    difference of the two final states."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    g = torch.Generator().manual_seed(0)
    t, hv, d = k + 1, 8, 64
    q, key = (torch.randn(1, t, hv // 2, d, generator=g).repeat_interleave(2, 2) for _ in range(2))
    v = torch.randn(1, t, hv, d, generator=g)
    decay, beta = -torch.rand(1, t, hv, generator=g), torch.rand(1, t, hv, generator=g)
    s0 = torch.randn(1, hv, d, d, generator=g) * 0.1
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)

    def chunk():
        return torch_chunk_gated_delta_rule(q, key, v, g=decay, beta=beta, initial_state=s0, **kw)[1]

    def per_position():
        state, states = s0, []
        for i in range(t):
            sl = slice(i, i + 1)
            _, state = torch_recurrent_gated_delta_rule(
                q[:, sl], key[:, sl], v[:, sl], g=decay[:, sl], beta=beta[:, sl], initial_state=state, **kw
            )
            states.append(state)
        return states

    with torch.no_grad():
        diff = float((per_position()[-1] - chunk()).abs().max() / chunk().abs().max())
        return {
            "chunk_ms": median_seconds(chunk, repeats) * 1e3,
            "per_position_ms": median_seconds(per_position, repeats) * 1e3,
            "final_state_rel_diff": diff,
        }


def compiled_round(arch: str, size: str, k: int, repeats: int) -> dict:
    """The chosen rollback inside one compiled function, as a round graph would hold it: snapshot
    (in place), the verify forward through specfx's static cache (``slot_cache_with_state``; KV
    at slots, explicit masks) with the mixer taps on, restore, K+1 predicated mixer steps. Counts
    Dynamo's graphs and breaks, checks Inductor's result against eager, and times the round
    against the compiled verify forward alone (ms, batch 1)."""
    import inspect

    from specfx.model.masks import build_mask, check_attn_implementation

    model = build(arch, size)
    cache = slot_cache_with_state(model.config, 1, 128, "cpu")
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    fmt = check_attn_implementation(model)

    def forward(ids, positions):
        cache.slots = positions
        mask = masks_with_state(model.config, build_mask(positions, cache.capacity, fmt, model.dtype), None)
        kw = {"position_ids": positions} if takes_positions else {}
        return model(input_ids=ids, attention_mask=mask, use_cache=True, cache=cache, **kw).logits

    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    with torch.no_grad():
        forward(torch.zeros((1, 1), dtype=torch.long), torch.full((1, 1), cache.trash_slot))
        for _, layer in stateful_layers(cache):
            layer.start()
        forward(torch.randint(3, vocab, (1, 16), generator=g), torch.arange(16).unsqueeze(0))
    snapshot, taps = StateSnapshot(cache), MixerTaps(model, cache)
    taps.attach()  # registering a hook cannot be traced; recording is switched by taps.on
    ids = torch.randint(3, vocab, (1, k + 1), generator=g)
    positions = 16 + torch.arange(k + 1).unsqueeze(0)
    n = torch.tensor([k // 2])

    def round_fn(ids, positions, n):
        snapshot.take()
        taps.on = True
        logits = forward(ids, positions)
        taps.on = False
        snapshot.restore()
        taps.replay_steps(cache, n, k + 1)
        return logits

    def verify_fn(ids, positions, n):
        return forward(ids, positions)

    def decode_fn(ids, positions, n):  # one single-token forward: "steps" costs K+1 of them
        return forward(ids[:, :1], positions[:, :1])

    start = [t.clone() for _, _, t in snapshot.tensors]
    live = [(states, idx) for states, idx, _ in snapshot.tensors]

    def reset():
        for (states, idx), t in zip(live, start, strict=True):
            states[idx].copy_(t)

    out = {}
    with torch.no_grad():
        reset()
        ref = round_fn(ids, positions, n)
        ref_state = [states[idx].clone() for states, idx in live]
        reset()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(round_fn)(ids, positions, n)
        out["graphs"], out["breaks"] = explained.graph_count, explained.graph_break_count
        torch._dynamo.reset()
        t0 = time.perf_counter()
        compiled = torch.compile(round_fn, fullgraph=True)
        reset()
        got = compiled(ids, positions, n)
        out["compile_s"] = time.perf_counter() - t0
        out["logits_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
        out["state_rel_diff"] = max(
            float((states[idx] - r).abs().max() / r.abs().max().clamp_min(1e-30))
            for (states, idx), r in zip(live, ref_state, strict=True)
        )
        verify = torch.compile(verify_fn, fullgraph=True)
        decode = torch.compile(decode_fn, fullgraph=True)
        timed = (("eager_round_ms", round_fn), ("round_ms", compiled), ("verify_ms", verify), ("decode_ms", decode))
        for name, fn in timed:
            out[name] = median_seconds(lambda fn=fn: (reset(), fn(ids, positions, n)), repeats) * 1e3
    taps.detach()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="*", default=["qwen3_next", "mamba2"])
    parser.add_argument("--sizes", nargs="*", default=["tiny", "medium"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compiled", action="store_true", help="also the chosen rollback in one Inductor graph")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(f"{' '.join(sys.argv)}; threads {torch.get_num_threads()}; load {os.getloadavg()}; K={args.k}")
    rows = []
    for arch in args.archs:
        for size in args.sizes:
            model = build(arch, size)
            params = sum(p.numel() for p in model.parameters())
            exact = check(model, args.k)
            conv = check_conv(model, args.k)
            ms = timings(model, args.k, args.repeats)
            row = {"arch": arch, "size": size, "params": params, "exact": exact, "conv_state_after": conv, "ms": ms}
            rows.append(row)
            print(
                f"\n{arch} {size} ({params / 1e6:.2f}M params, state {ms['state_bytes'] / 1e3:.0f} kB), load {os.getloadavg()[0]:.2f}"
            )
            print(
                f"  decode {ms['decode']:.2f} ms, verify(K+1) {ms['verify']:.2f} ms, snapshot {ms['snapshot']:.3f} ms, restore {ms['restore']:.3f} ms"
            )
            print(f"  conv_state_after (from update_conv_state's inputs): max rel err {conv:.1e}")
            print(
                "  | method | extra ms per round | x decode | round = verify + extra, x decode | state err | next-logit err |"
            )
            for method in ("replay_model", "replay_mixers", "mixer_steps", "steps"):
                extra = ms[method] + (ms["snapshot"] + ms["restore"] if method != "steps" else 0.0)
                rnd = (ms["verify"] if method != "steps" else 0.0) + extra
                s_err, l_err = exact[method]
                print(
                    f"  | {method} | {extra:.2f} | {extra / ms['decode']:.2f} | {rnd / ms['decode']:.2f} | {s_err:.1e} | {l_err:.1e} |"
                )
    if args.compiled:
        for arch in args.archs:
            for size in args.sizes:
                c = compiled_round(arch, size, args.k, args.repeats)
                rows.append({"arch": arch, "size": size, "compiled_round": c})
                print(
                    f"\ncompiled round, {arch} {size}: {c['graphs']} graph(s), {c['breaks']} break(s), compile "
                    f"{c['compile_s']:.0f} s; vs eager: logits {c['logits_rel_diff']:.1e}, state {c['state_rel_diff']:.1e}; "
                    f"verify alone {c['verify_ms']:.2f} ms, verify + snapshot + mixer steps {c['round_ms']:.2f} ms "
                    f"(eager {c['eager_round_ms']:.2f} ms), decode step {c['decode_ms']:.2f} ms (K+1 of them: "
                    f"{(args.k + 1) * c['decode_ms']:.2f} ms), load {os.getloadavg()[0]:.2f}"
                )
    kern = gdn_kernels(args.k, 3 * args.repeats)
    print(
        f"\nGDN layer (medium shapes, T={args.k + 1}): chunked kernel {kern['chunk_ms']:.3f} ms, per-token kernel "
        f"keeping every state {kern['per_position_ms']:.3f} ms (final states differ by {kern['final_state_rel_diff']:.1e})"
    )
    rows.append({"gdn_kernels": kern})
    print(f"load at end {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
