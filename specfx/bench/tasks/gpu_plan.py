"""Plan of the GPU benchmark (:mod:`specfx.bench.tasks.gpu`): model shapes, which methods run where, and a
prediction of the runtime, so that a run can be sized to the 10-minute limit of one command
on the lent GPU before any device time is spent (``specfx bench gpu --dry-run``).

The prediction is a sum over the steps of each (pair, batch, context) combination:

    compile   graph_s + layer_s x decoder-layer instances in the graph (Inductor compile time
              grows with the graph; a round unrolls K draft forwards and the verification)
    per call  prefill (2 x params x tokens / flops) + new tokens x step time, where a step is
              max(eager launch time, bandwidth floor) for HF's eager loops and
              floor / efficiency (+ host time per round) for compiled ones

with the constants in :data:`ASSUMED`. They are guesses until calibrated by a GPU run, whose
JSON records each method's measured warm-up and call times next to the prediction.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specfx.bench.floor import forward_bytes, meta_model
from specfx.bench.harness import log
from specfx.bench.oracle import expected_acceptance

__all__ = [
    "SHAPES",
    "PAIRS",
    "METHODS",
    "ASSUMED",
    "llama_config",
    "build_model",
    "plan",
    "method_rows",
    "family",
    "auto_ks",
    "Predictor",
    "print_plan",
]

# Llama-3-like shapes (vocab 128256). 8B is untied like Llama-3.1-8B; the small ones tie the
# LM head to the embedding like Llama-3.2-1B. The tiny ones are for --smoke.
SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "150m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256, tie_word_embeddings=False),
    "tiny1": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, tie_word_embeddings=False),
}  # fmt: skip
PAIRS = {"8b-1b": ("8b", "1b"), "1b-150m": ("1b", "150m"), "tiny": ("tiny", "tiny1")}
# in the order they run: the reference and the baseline first, then the cheapest compiles.
# specfx_auto / specfx_auto_oracle: num_speculative_tokens="auto" (K chosen per window among 0 and
# --auto-k-values, one round graph each) with the real draft / the oracle at each --auto-alphas
METHODS = ("hf_dynamic", "hf_static_compiled", "specfx_oracle", "specfx_auto_oracle", "specfx_draft", "specfx_auto",
           "hf_assisted", "specfx_self")  # fmt: skip
FAMILIES = ("specfx_auto_oracle", "specfx_oracle")  # methods with one row per alpha: <family>_<alpha>
OVERHEAD_FAMILIES = ("specfx_oracle", "specfx_draft", "specfx_self")  # fixed K: round overhead timed in parts

# Rough costs for predicting a run (--dry-run, the budget guard). Guesses until a GPU run
# calibrates them: its JSON has every method's measured warm-up (compile) and call times next
# to the prediction; override with --assume key=value.
ASSUMED = {
    "cuda": dict(bandwidth=4.3e12, flops=6e14, graph_s=20.0, layer_s=1.5, eager_layer_s=6e-4, efficiency=0.6,
                 host_round_s=3e-4),
    "cpu": dict(bandwidth=2e10, flops=5e10, graph_s=6.0, layer_s=2.5, eager_layer_s=3e-4, efficiency=0.05,
                host_round_s=1e-3),
}  # fmt: skip


# ----------------------------------------------------------------------------- models
def llama_config(shape: str, args) -> LlamaConfig:
    max_positions = 1 << math.ceil(math.log2(max(args.contexts) + args.new_tokens + 2 * args.k + 8))
    return LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=max(max_positions, 256),
        initializer_range=args.init_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_model(shape: str, args, seed: int):
    """A random-weight Llama of ``shape``, created directly on the device in the bench dtype."""
    torch.manual_seed(seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            llama_config(shape, args), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        )
    # a no-op when the device context took effect; guards against an init path that ignores it
    model = model.to(args.device)
    if getattr(args, "weights", "random") == "peaked":
        peak_logits(model, seed)
    model.generation_config.eos_token_id = None  # every method generates exactly --new-tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def peak_logits(model, seed: int, residual_scale: float = 1e-3) -> None:
    """Give a random-weight Llama a wide margin between its greedy token and the rest.

    Random init gives near-flat logits over 128k tokens: the top two are within bf16 rounding
    at most steps, so HF's one-token steps and a (K+1)-token verification pick different tokens
    within a few steps, and an oracle built from HF's greedy output stops matching (measured on
    the H200: α = 1 accepted 1.7 % of proposals). Here every attention and MLP output
    projection is scaled by ``residual_scale`` (the residual stream stays close to the token's
    embedding, the layers still run on every position) and, for an untied head, row j of the
    LM head is the embedding of token π(j) for a seeded permutation π: the greedy successor of
    token x is π⁻¹(x), about 10x above the next logit. A tied head makes the successor x itself.
    Shapes, dtypes and the bytes every kernel reads are those of the random model; only the
    values differ (none is zero)."""
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.mul_(residual_scale)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head.data_ptr() != emb.data_ptr():
        g = torch.Generator(device="cpu").manual_seed(seed + 12345)
        perm = torch.randperm(emb.shape[0], generator=g).to(emb.device)
        head.copy_(emb[perm])


def layers(shape: str) -> int:
    return SHAPES[shape]["num_hidden_layers"]


def plan(args) -> list[tuple[str, int, int]]:
    return [(pair, b, c) for pair in args.shapes for c in args.contexts for b in args.batches]


def method_rows(args, batch: int) -> list[str]:
    rows = []
    for m in args.methods:
        if m == "hf_assisted" and batch > 1:
            continue  # HF assisted generation refuses batch > 1
        if m in FAMILIES:
            rows += [f"{m}_{a:g}" for a in (args.alphas if m == "specfx_oracle" else args.auto_alphas)]
        else:
            rows.append(m)
    return rows


def family(row: str) -> str:
    """The method (and generator) a row belongs to: ``specfx_oracle_0.6`` -> ``specfx_oracle``."""
    return next((f for f in FAMILIES if row.startswith(f + "_")), row)


def auto_ks(args) -> tuple[int, ...]:
    """The Ks an "auto" generator compiles a round graph for (and times): 0 and --auto-k-values."""
    return (0, *args.auto_k_values)


# ----------------------------------------------------------------------------- prediction
class Predictor:
    """Predicted seconds of every step of a combination (see ASSUMED)."""

    def __init__(self, args):
        self.args, self.a = args, args.assumed
        dtype = getattr(torch, args.dtype)
        self.meta = {s: meta_model(llama_config(s, args), dtype) for pair in args.shapes for s in PAIRS[pair]}

    def graph(self, layer_instances: int) -> float:
        return self.a["graph_s"] + self.a["layer_s"] * layer_instances

    def _fwd(self, shape, batch, tokens, ctx) -> float:
        return forward_bytes(self.meta[shape], batch, tokens, ctx).total / self.a["bandwidth"]

    def prefill(self, shape, batch, ctx) -> float:
        params = sum(p.numel() for p in self.meta[shape].parameters())
        return 2 * params * batch * ctx / self.a["flops"] + layers(shape) * self.a["eager_layer_s"]

    def steps(self, pair, batch, ctx) -> dict:
        """(compile seconds, seconds per generate call) per method row."""
        t, d = PAIRS[pair]
        k, n, a = self.args.k, self.args.new_tokens, self.a
        mid = ctx + n // 2
        eff, host = a["efficiency"], a["host_round_s"]
        eager = a["eager_layer_s"]
        step_t = self._fwd(t, batch, 1, mid)
        verify = self._fwd(t, batch, k + 1, mid)
        step_d = self._fwd(d, batch, 1, mid)
        pre = self.prefill(t, batch, ctx)
        pre_d = self.prefill(d, batch, ctx)
        out = {
            "hf_dynamic": (0.0, pre + n * max(layers(t) * eager, step_t)),
            "hf_static_compiled": (self.graph(layers(t)), pre + n * (step_t / eff + host)),
            "hf_assisted": (
                0.0,
                pre + pre_d + n * (k * max(layers(d) * eager, step_d) + max(layers(t) * eager, verify)),
            ),
            "specfx_draft": (
                self.graph(layers(t) + k * layers(d)),
                pre + pre_d + n * ((verify + k * step_d) / eff + host),
            ),
            "specfx_self": (
                self.graph(layers(t) * (k + 1)),
                pre * 2 + n / (k + 1) * ((verify + k * step_t) / eff + host),
            ),
        }
        for i, alpha in enumerate(self.args.alphas):
            tau = expected_acceptance(alpha, k)[1]
            out[f"specfx_oracle_{alpha:g}"] = (
                self.graph(layers(t)) if i == 0 else 0.0,
                pre + n / tau * (verify / eff + host),
            )
        # "auto": one round graph per candidate K (K = 0 included), all compiled and timed
        # (2 + 7 calls each) in the first call; the calls priced at the best K of the floor
        ks = auto_ks(self.args)
        timing = 9 * sum(self._fwd(t, batch, kk + 1, mid) / eff + host for kk in ks)
        draft_timing = timing + 9 * sum(kk * step_d / eff for kk in ks)
        out["specfx_auto"] = (
            sum(self.graph(layers(t) + kk * layers(d)) for kk in ks) + draft_timing,
            pre + pre_d + n * (step_t / eff + host),  # a draft that accepts nothing: K = 0
        )
        for i, alpha in enumerate(self.args.auto_alphas):
            per_token = [step_t / eff + host]  # K = 0: plain decoding
            for kk in ks[1:]:
                per_token.append((self._fwd(t, batch, kk + 1, mid) / eff + host) / expected_acceptance(alpha, kk)[1])
            compile_s = self.graph(layers(t)) * len(ks) + timing if i == 0 else 0.0
            out[f"specfx_auto_oracle_{alpha:g}"] = (compile_s, pre + n * min(per_token))
        rows = self.args.methods
        parts = self.graph(layers(t))  # verify
        parts += self.graph(layers(d)) if "specfx_draft" in rows else 0.0
        parts += self.graph(layers(t)) if "specfx_self" in rows else 0.0
        out["parts"] = (parts, 0.0)
        out["reference"] = (0.0, out["hf_dynamic"][1] * (n + k + 1) / n)
        out["build"] = (0.0, 2.0 + sum(p.numel() for s in (t, d) for p in self.meta[s].parameters()) / 2e9)
        return out

    def combo(self, pair, batch, ctx) -> float:
        steps = self.steps(pair, batch, ctx)
        calls = 1 + self.args.repeats
        rows = method_rows(self.args, batch)
        total = sum(steps[m][0] + calls * steps[m][1] for m in rows)
        if any(family(m) in FAMILIES for m in rows):
            total += steps["reference"][1]
        if not self.args.no_overhead and any(family(m) in OVERHEAD_FAMILIES for m in rows):
            total += steps["parts"][0]
        return total


def print_plan(args, predictor) -> float:
    total, last_pair = 0.0, None
    log(f"plan: K={args.k}, {args.new_tokens} new tokens, {args.repeats} repeats, {args.dtype} on {args.device}")
    for pair, b, c in plan(args):
        s = predictor.combo(pair, b, c)
        if pair != last_pair:
            s += predictor.steps(pair, b, c)["build"][1]
            last_pair = pair
        total += s
        steps = predictor.steps(pair, b, c)
        compile_s = sum(steps[m][0] for m in method_rows(args, b))
        log(
            f"  {pair:<8} B={b:<3} ctx={c:<5} predicted {s:6.0f} s (compiles {compile_s:4.0f} s)   "
            f"methods: {' '.join(method_rows(args, b))}"
        )
    log(f"predicted total {total:.0f} s ({total / 60:.1f} min); budget {args.budget_s:.0f} s")
    return total
