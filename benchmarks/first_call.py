"""First calls of specfx's default on SmolLM2-135M-Instruct (issue 27 item 3, decision 67).

Five calls in one process, each greedy with up to 128 new tokens and checked token for token
against HF ``generate()``: a code request, a code edit (a longer prompt: the live-KV bound
grows), a 377-token passage (the buffers grow to 1024 slots), a batch of 2 (a new batch bucket),
and a code request again. Per call it prints the time to the first streamed token, the longest
pause between two streamed tokens (a compile in the caller's thread shows up here), the call's
time and the graphs still compiling; at the end ``wait_for_graphs()`` and every compile event.
One torch thread (``THREADS``). The Inductor cache is ``TORCHINDUCTOR_CACHE_DIR``: a new empty
directory for a cold run, the same again for a second process. ``KW``: speculate() options as
JSON, e.g. ``KW='{"background_compile": false}'`` for the foreground compiles of before::

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/first_call.py
"""

import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specfx
from specfx.demo.smollm2 import smollm2_dir

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
T0 = time.monotonic()
d = smollm2_dir()
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
passage = " ".join(
    [
        "The committee met on Tuesday to review the budget for the new library, the repairs to the bridge, and the plan for the summer festival."
    ]
    * 12
)
calls = [
    ("code", ["Write a Python function that returns the n-th Fibonacci number."]),
    (
        "edit",
        [
            "Rewrite this code to use a list comprehension:\n\nresult = []\nfor x in range(10):\n    if x % 2 == 0:\n        result.append(x * x)\n"
        ],
    ),
    ("long prompt", [f"Summarise this passage in one sentence:\n\n{passage}"]),
    ("batch 2", ["Name three primary colours.", "What is the capital of France? Answer in one word."]),
    ("code again", ["Write a Python function that checks whether a string is a palindrome."]),
]


class Clock:
    def __init__(self):
        self.times = []

    def put(self, v):
        self.times.append(time.monotonic())

    def end(self):
        pass


kw = json.loads(os.environ.get("KW", "{}"))
t = time.monotonic()
spec = specfx.speculate(model, **kw)
print(
    json.dumps(
        {
            "speculate_s": round(time.monotonic() - t, 2),
            "load_s": round(t - T0, 1),
            "kw": kw,
            "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        }
    ),
    flush=True,
)
for name, texts in calls[: int(os.environ.get("CALLS", "5"))]:
    tok.padding_side = "left"
    chats = [
        tok.apply_chat_template([{"role": "user", "content": x}], add_generation_prompt=True, tokenize=False)
        for x in texts
    ]
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    clock = Clock() if len(texts) == 1 else None
    t = time.monotonic()
    out = spec.generate(**enc, max_new_tokens=128, do_sample=False, streamer=clock)
    dt = time.monotonic() - t
    ref = model.generate(**enc, max_new_tokens=128, do_sample=False)
    row = dict(
        call=name,
        prompt_tokens=enc["input_ids"].shape[1],
        batch=len(texts),
        call_s=round(dt, 1),
        new=int((out[:, enc["input_ids"].shape[1] :] != tok.pad_token_id).sum()),
        equal=torch.equal(ref, out),
        compiling=len(spec.compiling),
        load=round(os.getloadavg()[0], 1),
    )
    if clock is not None:
        stamps = [t] + clock.times[1:]  # the first put is the prompt
        row["first_token_s"] = round(stamps[1] - t, 2)
        row["max_pause_s"] = round(max(b - a for a, b in zip(stamps, stamps[1:], strict=False)), 2)
    print(json.dumps(row), flush=True)
t = time.monotonic()
spec.wait_for_graphs()
print(
    json.dumps(
        {
            "wait_for_graphs_s": round(time.monotonic() - t, 1),
            "events": [
                (e.key[1], e.key[2], e.key[3], e.key[-1], round(e.seconds, 1), e.background)
                for e in spec.compile_events
            ],
        }
    ),
    flush=True,
)
