"""The benchmark oracle drafter (specfx/bench/oracle.py) and the bandwidth floor model
(specfx/bench/floor.py): eager rounds on tiny models, one compiled round, hand-computed floors."""

import copy
import math

import pytest
import torch
from transformers import GPT2Config, LlamaConfig
from transformers.generation.logits_process import LogitsProcessorList

import specfx
from specfx.bench.floor import (
    decode_floor_seconds,
    device_time,
    forward_bytes,
    fraction_of_floor,
    ideal_tokens_per_s,
    kv_bytes_read,
    kv_geometry,
    measure_copy_bandwidth,
    meta_model,
    round_floor_seconds,
    weight_bytes_read,
)
from specfx.bench.oracle import OracleDrafter, expected_acceptance, greedy_continuation
from specfx.passes.checks.no_host_sync import offending_nodes
from tests.conftest import left_padded, pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")

K = 4


def _oracle_run(alpha, ids, new, mask=None, backend=None):
    target = pair("llama", "self")[0]
    reference = greedy_continuation(target, ids, mask, new_tokens=new + K + 1)
    oracle = OracleDrafter(alpha, reference)
    options = dict(compile=False) if backend is None else dict(compile=True, backend=backend, compile_prefill=True, background_compile=False)
    spec = specfx.speculate(target, draft=oracle, num_speculative_tokens=K, **options)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return spec, out, expected


# ----------------------------------------------------------------------------- oracle
def test_alpha_one_accepts_every_proposal():
    new = 30
    spec, out, expected = _oracle_run(1.0, prompt(7, seed=3), new)
    assert torch.equal(out, expected)
    s = spec.stats
    assert s.proposed > 0 and s.accepted == s.proposed  # acceptance rate exactly 1
    # every round emits K + 1 tokens except the last, cut at the length limit: prefill makes
    # the first of the 30 new tokens, the rounds the other 29
    assert s.emitted == new - 1
    assert s.rounds == math.ceil((new - 1) / (K + 1))
    assert s.per_position == [s.rounds] * K


def test_alpha_zero_accepts_nothing():
    new = 20
    spec, out, expected = _oracle_run(0.0, prompt(5, seed=4), new)
    assert torch.equal(out, expected)
    assert spec.stats.accepted == 0 and spec.stats.proposed == K * (new - 1)
    assert spec.stats.rounds == new - 1  # one token (the correction) per round


def test_alpha_06_acceptance_rate_within_statistical_band():
    """Accepted length A per row-round is truncated geometric, P(A >= i) = α^i (i <= K), so
    E[A] = Σ α^i and E[A²] = Σ (2i - 1) α^i. Over n row-rounds the acceptance rate ΣA / (nK)
    has standard deviation sd(A) / (K √n); the band is ±4 of those (two-sided 6e-5 under the
    normal approximation). The random stream is counter-based with a fixed seed, so the
    outcome is deterministic, not flaky; the band says the oracle draws what it claims."""
    alpha, new = 0.6, 150
    spec, out, expected = _oracle_run(alpha, prompt(8, batch=4, seed=5), new)
    assert torch.equal(out, expected)
    s = spec.stats
    n = s.proposed // K  # row-rounds
    mean = sum(alpha**i for i in range(1, K + 1))
    var = sum((2 * i - 1) * alpha**i for i in range(1, K + 1)) - mean**2
    assert n > 200
    assert abs(s.acceptance_rate - mean / K) <= 4 * math.sqrt(var / n) / K
    # the first proposal alone is a Bernoulli(α)
    assert abs(s.per_position[0] / n - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / n)
    rate, tau = expected_acceptance(alpha, K)
    assert rate == pytest.approx(mean / K) and tau == pytest.approx(mean + 1)


def test_left_padded_batch_of_three_rows():
    ids, mask = left_padded(10, (4, 0, 7), seed=6)
    spec, out, expected = _oracle_run(1.0, ids, 25, mask)
    assert torch.equal(out, expected)
    assert spec.stats.accepted == spec.stats.proposed > 0
    spec, out, expected = _oracle_run(0.6, ids, 25, mask)
    assert torch.equal(out, expected)
    assert 0 < spec.stats.accepted < spec.stats.proposed


def test_greedy_continuation_is_position_indexed():
    target = pair("llama", "self")[0]
    ids = prompt(6, batch=2, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref = greedy_continuation(target, ids, mask, new_tokens=5)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    assert ref.shape == (2, 11)
    assert torch.equal(ref[0], out[0])
    assert torch.equal(ref[1, :9], out[1, 2:]) and (ref[1, 9:] == 0).all()  # 2 padding columns dropped


def test_greedy_continuation_runs_past_eos():
    """Proposals after a row's EOS must still be the target's greedy tokens (the round counts
    acceptance before truncating at EOS), so the reference ignores the model's EOS."""
    target = copy.deepcopy(pair("llama", "self")[0])
    ids = prompt(6, seed=11)
    free = target.generate(ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    target.generation_config.eos_token_id = int(free[0, 6 + 5])  # a token the continuation emits
    assert target.generate(ids, max_new_tokens=20, pad_token_id=0).shape[1] < free.shape[1]  # HF stops there
    assert torch.equal(greedy_continuation(target, ids, new_tokens=20), free)


def test_set_alpha_and_reference_write_in_place():
    target = pair("llama", "self")[0]
    ids = prompt(5, seed=8)
    oracle = OracleDrafter(1.0, greedy_continuation(target, ids, new_tokens=20))
    spec = specfx.speculate(target, draft=oracle, num_speculative_tokens=K, compile=False)
    spec.generate(ids, max_new_tokens=10)
    alpha, buffer = oracle.alpha, oracle.buffer
    oracle.set_alpha(0.25)
    oracle.set_reference(greedy_continuation(target, prompt(5, seed=9), new_tokens=20))
    assert oracle.alpha is alpha and float(alpha) == 0.25  # a compiled round sees the new values
    assert oracle.buffer is buffer


@pytest.mark.full
def test_sampling_with_the_oracle_keeps_the_target_distribution():
    """The docstring's claim: under sampling the oracle is deterministic given its own stream
    (q one-hot), so output follows the target exactly (same chi-square test as test_lossless)."""
    from tests.lossless.test_lossless import NEW, ROWS, _chisquare, _exact, _models

    target, _ = _models()
    prompt_ids = [1, 4, 2]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    ids = torch.tensor([prompt_ids]).repeat(ROWS, 1)
    reference = greedy_continuation(target, ids[:1], new_tokens=NEW + K + 1).repeat(ROWS, 1)
    spec = specfx.speculate(target, draft=OracleDrafter(0.6, reference), num_speculative_tokens=K, compile=False)
    torch.manual_seed(99)
    out = spec.generate(ids, do_sample=True, max_new_tokens=NEW, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="alpha must be a number in"):
        OracleDrafter(1.5)
    with pytest.raises(TypeError, match="int64 tensor"):
        OracleDrafter(0.5, torch.zeros(2, 3))
    target = pair("llama", "self")[0]
    ids = prompt(4, batch=2, seed=1)
    with pytest.raises(ValueError, match="left padding"):
        greedy_continuation(target, ids, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), new_tokens=3)
    oracle = OracleDrafter(0.5, greedy_continuation(target, ids, new_tokens=8))
    spec = specfx.speculate(target, draft=oracle, num_speculative_tokens=K, compile=False)
    with pytest.raises(ValueError, match="reference has 2 rows"):
        spec.generate(prompt(4, batch=3, seed=2), max_new_tokens=4)


def test_oracle_inside_the_captured_round_graph():
    """The oracle in a round captured whole by Dynamo (fullgraph) and checked by specfx's
    passes (no host sync). Backend specfx_eager skips Inductor's code generation, which took
    over 60 s of CPU here; the same round compiled by Inductor is what
    ``bench_gpu.py --smoke --backend specfx`` runs."""
    spec, out, expected = _oracle_run(0.8, prompt(9, seed=10), 30, backend="specfx_eager")
    assert torch.equal(out, expected)
    assert 0 < spec.stats.accepted < spec.stats.proposed
    assert len(spec.graphs) == 2  # prefill and one round graph: the oracle added no graph break
    for g in spec.graphs:
        assert offending_nodes(g.graph_module) == []


# ----------------------------------------------------------------------------- floor
def _llama(tied: bool, dtype=torch.float32):
    # hidden 8, 4 heads (head_dim 2), 2 KV heads (GQA), MLP 16, 2 layers, vocab 32
    config = LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        tie_word_embeddings=tied,
    )
    return meta_model(config, dtype)


# Hand count: per layer q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, MLP 3 x 8x16 = 384, two norms 16
# -> 592; 2 layers 1184; final norm 8; LM head 32x8 = 256 -> 1448 parameters read in full.
# Untied, the input embedding (32x8) is a gather of B*T rows of 8.
def test_weight_bytes_count_each_tensor_once_and_gather_the_embedding():
    assert weight_bytes_read(_llama(tied=False), tokens=3) == 1448 * 4 + 3 * 8 * 4  # 5888
    assert weight_bytes_read(_llama(tied=False), tokens=100) == 1448 * 4 + 32 * 8 * 4  # at most every row
    assert weight_bytes_read(_llama(tied=True), tokens=3) == 1448 * 4  # tied: the LM head reads it all
    assert weight_bytes_read(_llama(tied=False, dtype=torch.bfloat16), tokens=3) == 5888 // 2


def test_kv_bytes_with_grouped_query_attention():
    config = _llama(tied=False).config
    assert kv_geometry(config) == (2, 2, 2)  # layers, kv_heads, head_dim
    # 2 layers x (K, V) x B=2 x 2 kv heads x ctx 10 x head_dim 2 x 4 bytes
    assert kv_bytes_read(config, batch=2, context=10, dtype=torch.float32) == 2 * 2 * 2 * 2 * 10 * 2 * 4  # 1280
    assert kv_geometry(GPT2Config(n_layer=3, n_head=4, n_embd=16)) == (3, 4, 4)  # no GQA: one KV head per head


def test_round_and_decode_floors():
    target, draft, bw = _llama(tied=False), _llama(tied=True), 1000.0
    # target over K+1 = 4 tokens x 2 rows: 5792 + gather 8 rows x 32 B = 6048, KV 1280 -> 7328
    assert forward_bytes(target, batch=2, tokens_per_row=4, context=10).total == 7328
    # draft step: 5792 (tied) + KV 1280 = 7072, three of them
    assert round_floor_seconds(target, draft, k=3, batch=2, context=10, bandwidth=bw) == pytest.approx(
        (7328 + 3 * 7072) / bw
    )
    assert round_floor_seconds(target, None, k=3, batch=2, context=10, bandwidth=bw) == pytest.approx(7.328)
    # decode step: 5792 + gather 2 rows x 32 B + KV 1280 = 7136
    decode = decode_floor_seconds(target, batch=2, context=10, bandwidth=bw)
    assert decode == pytest.approx(7.136)
    assert ideal_tokens_per_s(2.5, 28.544, batch=2) == pytest.approx(2 * 2.5 / 28.544)
    assert fraction_of_floor(0.1, ideal_tokens_per_s(1.0, decode, batch=2)) == pytest.approx(0.1 * 7.136 / 2)


def test_device_time_and_copy_bandwidth_on_cpu():
    calls = []
    t = device_time(lambda: calls.append(1), "cpu", iters=7, warmup=2)
    assert len(calls) == 9 and t >= 0
    bw = measure_copy_bandwidth("cpu", nbytes=1 << 20, iters=3)
    assert math.isfinite(bw) and bw > 0


# ----------------------------------------------------------------------------- specfx bench gpu
def test_bench_gpu_dry_run_predicts_the_full_config(capsys):
    from specfx.bench.tasks.gpu import main

    assert main(["--dry-run"]) == 0  # meta-device models: nothing is allocated
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert out.count("predicted ") == 13  # 2 pairs x 3 batches x 2 contexts, and the total


@pytest.mark.full
def test_bench_gpu_smoke_runs_every_step(tmp_path):
    """The script end to end on tiny CPU models with graphs captured by Dynamo (specfx_eager):
    the oracle at α = 1 accepts everything, tokens equal HF's, round overhead is measured."""
    import json
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable, "-m", "specfx.cli", "bench", "gpu", "--smoke", "--batches", "2", "--methods",
        "hf_dynamic,specfx_oracle,specfx_draft", "--alphas", "1", "--repeats", "1", "--micro-iters", "2",
        "--out-dir", str(tmp_path), "--tag", "t",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    combo = json.loads((tmp_path / "bench_t.json").read_text())["combos"][0]
    oracle = combo["methods"]["specfx_oracle_1"]
    assert oracle["spec_stats"]["acceptance_rate"] == 1.0 and oracle["spec_stats"]["tau"] == 5.0
    assert all(m["same_tokens_as_hf_dynamic"] for m in combo["methods"].values())
    assert combo["round_overhead"]["overhead[specfx_draft]"] > 0
    assert (tmp_path / "bench_t.md").read_text().count("| tiny | 2 | 24 |") == 3


@pytest.mark.full
def test_bench_gpu_smoke_auto_falls_back_to_plain_decoding(tmp_path):
    """specfx_auto / specfx_auto_oracle on tiny CPU models (specfx_eager): "auto" times a round for
    K = 0 and each --auto-k-values, keeps HF's tokens, runs plain decoding once the oracle at
    α = 0 (and the unrelated random draft) has shown it accepts nothing, and speculates every
    window at α = 1; its ratio to HF static + compile is reported."""
    import json

    from specfx.bench.tasks.gpu import main

    argv = ["--smoke", "--batches", "2", "--methods", "hf_dynamic,hf_static_compiled,specfx_auto_oracle,specfx_auto",
            "--auto-k-values", "1,4", "--auto-alphas", "0,1", "--repeats", "1", "--out-dir", str(tmp_path), "--tag", "a"]  # fmt: skip
    assert main(argv) == 0
    methods = json.loads((tmp_path / "bench_a.json").read_text())["combos"][0]["methods"]
    assert all(m["status"] == "ok" and m["same_tokens_as_hf_dynamic"] for m in methods.values())
    for name in ("specfx_auto_oracle_0", "specfx_auto_oracle_1", "specfx_auto"):
        auto = methods[name]["spec_stats"]["auto_k"]
        assert sorted(map(int, auto["round_times_ms"])) == [0, 1, 4]  # (JSON keys are strings)
        assert methods[name]["speedup_vs_hf_static_compiled"] > 0

    def windows(name):
        return {int(k): v for k, v in methods[name]["spec_stats"]["auto_k"]["windows_per_k"].items()}

    for name in ("specfx_auto_oracle_0", "specfx_auto"):  # nothing accepted: K = 0 after the evidence
        assert methods[name]["spec_stats"]["accepted"] == 0
        assert windows(name).get(0, 0) > sum(windows(name).values()) / 2
    assert 0 not in windows("specfx_auto_oracle_1")
    assert methods["specfx_auto_oracle_1"]["spec_stats"]["acceptance_rate"] == 1.0
    assert "x HF static+compile (" in (tmp_path / "bench_a.md").read_text()


def test_peaked_weights_decide_the_greedy_token_by_a_wide_margin():
    """gpu_plan.peak_logits: same shapes and dtypes, nothing zero, and in bf16 the greedy
    token beats the runner-up by far more than rounding (plain random init does not)."""
    from specfx.bench.tasks.gpu_plan import peak_logits

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers_model(config).to(torch.bfloat16).eval()
    shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    ids = prompt(16, vocab=1024, seed=3)

    def margins():
        with torch.no_grad():
            top = model(ids).logits[0].float().topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp_min(1)

    before = margins()
    peak_logits(model, seed=0)
    after = margins()
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == shapes
    assert all(bool((p != 0).all()) for p in model.parameters())
    assert float(after.min()) > 0.5 > float(before.min())  # bf16 rounding is ~0.01 relative
    with torch.no_grad():  # the greedy successor of token x is π⁻¹(x): decided by x alone
        head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        succ = model(ids).logits[0].argmax(-1)
        assert torch.equal(emb[ids[0]], head[succ])


def transformers_model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.full
def test_gpu_check_smoke_on_cpu(tmp_path):
    """specfx bench gpu_check runs its drafter check on the CPU (specfx_eager: traced, not
    Inductor-compiled; the CUDA-only sync and profile checks are skipped there)."""
    import json

    from specfx.bench.tasks import gpu_check

    gpu_check.main(["--device", "cpu", "--backend", "specfx_eager", "--sections", "drafters", "--only",
                    "prompt_lookup,eagle_chain,pard,dflash", "--out-dir", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(r["name"], r["greedy_equal"], r["ok"]) for r in result["drafters"]] == [
        ("pard", True, True),
        ("dflash", True, True),
        ("prompt_lookup", True, True),
        ("eagle_chain", True, True),
    ]


@pytest.mark.full
def test_gpu_check_hybrid_smoke_on_cpu(tmp_path):
    """The ``hybrid`` section (stateful targets, issue 29 on the device) runs on the CPU: a GDN
    hybrid and LFM2's short convs with a hybrid draft model, equal to generate() with rounds that
    reject (the state rolled back)."""
    import json

    from specfx.bench.tasks import gpu_check

    gpu_check.main(["--device", "cpu", "--backend", "specfx_eager", "--sections", "hybrid", "--only",
                    "qwen3_next_draft,lfm2_draft", "--out-dir", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(r["name"], r["greedy_equal"], r["rolled_back"], r["ok"]) for r in result["hybrid"]] == [
        ("qwen3_next_draft", True, True, True),
        ("lfm2_draft", True, True, True),
    ]
    assert all(r["torch_counts"]["dynamo_graphs"] >= 1 for r in result["hybrid"])  # traced here, counted
