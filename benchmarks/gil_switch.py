"""Eager decoding beside a Python-busy thread, at two GIL switch intervals (decision 67).

Why the background compiler shortens Python's switch interval while it compiles: an eager round
is ~1000 small torch ops, each of which releases the GIL, and a thread running Python (as
Inductor's lowering and code generation do) then holds it until it is made to yield, up to the
switch interval. Alternates, in one process: eager specfx decoding of SmolLM2-135M-Instruct (K =
4, prompt lookup, 48 tokens, one torch thread) alone and beside a busy thread, at 5 ms (Python's
default) and 0.1 ms::

    python benchmarks/gil_switch.py
"""

import sys
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specfx
from specfx.demo.smollm2 import smollm2_dir

torch.set_num_threads(1)
d = smollm2_dir()
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
spec = specfx.speculate(model, num_speculative_tokens=4, compile=False)
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
kw = dict(max_new_tokens=48, eos_token_id=None)
spec.generate(ids, **kw)
stop = threading.Event()


def busy():
    while not stop.is_set():
        sum(range(20000))


def run(label):
    t = time.monotonic()
    spec.generate(ids, **kw)
    print(f"{label}: {48 / (time.monotonic() - t):.1f} tok/s", flush=True)


saved = sys.getswitchinterval()
try:
    for interval in (0.005, 0.0001, 0.005, 0.0001):
        sys.setswitchinterval(interval)
        run(f"alone,       switch {interval * 1e3:g} ms")
        stop.clear()
        thread = threading.Thread(target=busy)
        thread.start()
        run(f"beside busy, switch {interval * 1e3:g} ms")
        stop.set()
        thread.join()
finally:
    sys.setswitchinterval(saved)
