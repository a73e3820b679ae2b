"""Where an EAGLE-3 round's time goes on a CPU: torch.profiler over eager rounds of SmolLM2 with its
shipped head at K = 1 against prompt lookup at K = 1 (both verify 2 tokens), one thread; the top ops
by self time with their input shapes. ``python benchmarks/head_round_profile.py`` (docs/BENCHMARKS.md,
"SmolLM2-135M-Instruct with its EAGLE-3 head")."""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import specfx
from specfx.bench.tasks.suite_prompts import load_suite, make_batches
from specfx.demo.smollm2 import SMOLLM2_EAGLE3_DIR, load_smollm2


def main() -> None:
    torch.set_num_threads(1)
    model, tok = load_smollm2()
    (enc,) = make_batches(tok, [load_suite()["math_reasoning"][0]], 1, "cpu")
    for name, draft in (("prompt lookup", "prompt_lookup"), ("EAGLE-3 head", specfx.Eagle3(SMOLLM2_EAGLE3_DIR))):
        spec = specfx.speculate(model, draft=draft, num_speculative_tokens=1, compile=False)
        spec.generate(**enc, max_new_tokens=8)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            start = time.time()
            spec.generate(**enc, max_new_tokens=40)
            seconds = time.time() - start
        st = spec.stats
        print(f"=== {name}, K = 1: {seconds / st.rounds * 1000:.1f} ms a round (eager), {st.rounds} rounds, "
              f"tau {st.tokens_per_round:.2f}")  # fmt: skip
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=28, max_shapes_column_width=60
        )
        print(table)


if __name__ == "__main__":
    main()
