"""``specfx demo``: SmolLM2-135M-Instruct (:mod:`specfx.demo.smollm2`) answers chat prompts through
its chat template; specfx's answer is streamed as it is generated, then HF ``generate()``, HF's
own prompt lookup and specfx are timed side by side on the same prompts in the same run, and
specfx's greedy tokens are checked against HF ``generate()``'s.

Timing: every method first runs once over all prompts untimed (specfx's warm-up is the streamed
pass: its first tokens come at once while the round graphs compile in the background, which it
then waits for), then ``--repeats`` timed passes, interleaved (pass r runs
every method once over all prompts) so drift of the machine hits all alike; a method's time is
the median pass. EOS is kept, as a chat needs it: tokens/s counts the tokens each method actually
generated (greedy HF and specfx generate the same ones).
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from specfx.demo.smollm2 import SMOLLM2_EAGLE3_DIR
from specfx.demo.stream import PrintingMarkingStreamer, marks

__all__ = ["ChatPrompt", "CHAT_PROMPTS", "CHAT_DEFAULTS", "HEAD_KINDS", "chat_ids", "head_kind", "resolve_draft",
           "run_chat"]  # fmt: skip

# the chat demo's defaults for the options the pair demo defaults differently (cli.py: None = this)
CHAT_DEFAULTS = {"max_new_tokens": 128, "num_prompts": 4, "temperature": 0.7}
NAMED = ("prompt_lookup", "lookahead", "eagle3")  # --draft names (eagle3: the shipped head); else a head directory
HEAD_KINDS = ("eagle3", "eagle", "medusa")  # draft="kind:DIR" (specfx.drafters.registry)


@dataclass(frozen=True)
class ChatPrompt:
    """A built-in user message of the demo: ``kind`` says what it asks for (shown above it)."""

    kind: str
    text: str


_SNIPPET = """```python
def avg(nums):
    s = 0
    for n in nums:
        s = s + n
    return s / len(nums)
```"""

_BRIDGE = (
    "The Lindqvist Bridge opened in 1931 and carried trams across the river until 1968, when the city "
    "replaced its trams with buses. It was closed to all traffic in 1994 after engineers found corrosion "
    "in its steel cables. A public campaign raised the money for repairs, and the bridge reopened in 2003 "
    "as a footbridge and cycle path. Today about 12,000 people cross it every day, most of them by bicycle."
)

_VERSION_CONTROL = (
    "Version control systems record the history of a project's files. Each saved state, called a commit, "
    "stores who changed what and when, with a message explaining why. Because every earlier state is kept, "
    "a developer can compare versions, find the change that introduced a bug, and undo a mistake without "
    "losing later work. Branches let several people work on different features at the same time; their "
    "changes are combined later by merging. Distributed systems such as Git give every developer a full "
    "copy of the history, so most operations work offline and no single server is a point of failure."
)

CHAT_PROMPTS: tuple[ChatPrompt, ...] = (
    ChatPrompt(
        "code writing",
        "Write a Python function `count_words(text)` that returns a dictionary mapping each lowercase word "
        "in `text` to the number of times it occurs. Include a docstring and an example call.",
    ),
    ChatPrompt(
        "a question about a passage",
        f"Read this passage:\n\n{_BRIDGE}\n\nWhy was the bridge closed in 1994, and what is it used for today?",
    ),
    ChatPrompt(
        "a code edit",
        f"Here is a Python function:\n\n{_SNIPPET}\n\nRename it to `mean`, add type hints and a docstring, "
        "and make it return 0.0 for an empty list. Reply with the complete edited function.",
    ),
    ChatPrompt("a short summary", f"Summarize the following text in two sentences.\n\n{_VERSION_CONTROL}"),
)


def chat_ids(tokenizer, text: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """``text`` as a user message rendered by the tokenizer's chat template, ready for the
    assistant's answer: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
    as token ids ``[1, S]`` on ``device``."""
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded  # a BatchEncoding since transformers 5
    return torch.tensor([list(ids)], dtype=torch.long, device=device)


def head_kind(path: str | Path) -> str:
    """The kind of head stored in the directory ``path`` ("eagle3", "eagle" or "medusa"), read from
    its ``config.json`` as the public layouts write it (``architectures`` ``LlamaForCausalLMEagle3``
    / ``LlamaForCausalLMEagle``; ``model_type`` ``"medusa"``, or FasterDecoding's
    ``medusa_lm_head.safetensors``). ValueError if it cannot tell, saying how to name the kind."""
    import json

    p = Path(path).expanduser()
    config_file = p / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    architectures = " ".join(config.get("architectures") or []) if isinstance(config, dict) else ""
    if "Eagle3" in architectures:
        return "eagle3"
    if "Eagle" in architectures:
        return "eagle"
    if (isinstance(config, dict) and config.get("model_type") == "medusa") or (
        p / "medusa_lm_head.safetensors"
    ).is_file():
        return "medusa"
    raise ValueError(
        f"cannot tell which kind of head {str(p)!r} holds (its config.json names no EAGLE-3, EAGLE or Medusa "
        f"architecture): name it, e.g. --draft eagle3:{p}, --draft eagle:{p} or --draft medusa:{p}."
    )


def resolve_draft(value: str | None) -> str | None:
    """``--draft`` as ``speculate(draft=...)`` takes it: None (the default drafter: prompt lookup
    for SmolLM2), ``"prompt_lookup"``, ``"lookahead"``, ``"kind:DIR"`` for a head directory of a
    named kind, or a head directory whose kind :func:`head_kind` reads; ``"eagle3"`` alone is the
    EAGLE-3 head shipped for SmolLM2 (``SMOLLM2_EAGLE3_DIR``). ValueError otherwise."""
    if value == "eagle3":
        return f"eagle3:{SMOLLM2_EAGLE3_DIR}"
    if value is None or value in NAMED:
        return value
    kind, sep, rest = value.partition(":")
    if sep and kind in HEAD_KINDS:
        return value
    if Path(value).expanduser().is_dir():
        return f"{head_kind(value)}:{value}"
    raise ValueError(
        f"--draft {value!r} is neither {' nor '.join(NAMED)} nor a head directory (EAGLE-3, EAGLE or Medusa "
        f"heads trained for SmolLM2-135M-Instruct, e.g. with `specfx train --target $(python -c 'from "
        f"specfx.demo.smollm2 import smollm2_dir; print(smollm2_dir())')`)."
    )


def _load(args):
    """``(model, tokenizer)``, or SystemExit with a one-line message saying how to get the model."""
    from specfx.demo.smollm2 import GGUF_ENV, load_smollm2

    try:
        return load_smollm2(torch.float32, args.device, gguf=args.gguf)
    except (RuntimeError, FileNotFoundError, ImportError, ValueError) as e:
        fix = (
            f"pass --gguf PATH (or set {GGUF_ENV}) to a copy of SmolLM2-135M-Instruct.Q4_1.gguf, or run once "
            "with network access to fetch it; `specfx demo --pair` runs the shipped 4M-parameter pair without it"
        )
        message = " ".join(f"{e}".split())
        raise SystemExit(
            f"specfx demo: error: SmolLM2-135M-Instruct could not be loaded: {message} To fix: {fix}."
        ) from None


def _wait_for_graphs(spec) -> None:
    """Wait for the round graphs the streamed pass queued (compiled in the background,
    ARCHITECTURE decision 67; a no-op when they compiled in the foreground)."""
    from specfx.bench.harness import spinner

    with spinner("waiting for specfx's graphs compiled in the background (minutes on a small CPU, once)"):
        spec.wait_for_graphs()


def _time(methods: dict, ids: list[torch.Tensor], repeats: int, warm: list[str]) -> tuple[dict, dict]:
    """One untimed pass over ``ids`` of each method named in ``warm``, then ``repeats`` timed
    passes of every method, interleaved: ``(seconds per pass, outputs of the last pass)`` per method."""
    from tqdm.auto import tqdm

    from specfx.bench.harness import run_all

    times: dict[str, list[float]] = {name: [] for name in methods}
    outputs: dict[str, list[torch.Tensor]] = {}
    with tqdm(total=len(warm) + repeats * len(methods), desc="timing", leave=False, file=sys.stderr) as bar:
        for name in warm:
            bar.set_postfix_str(f"warm-up {name}")
            run_all(methods[name], ids)
            bar.update(1)
        for r in range(repeats):
            for name, fn in methods.items():
                bar.set_postfix_str(f"pass {r + 1} {name}")
                dt, outputs[name] = run_all(fn, ids)
                times[name].append(dt)
                bar.update(1)
    return times, outputs


def run_chat(args) -> int:
    """``specfx demo`` (``args`` from its parser, the chat defaults filled in): streams specfx's
    answers, prints the speed table, τ and the identical-output check. Exit status 1 if specfx's
    greedy output differs from HF ``generate()``'s; SystemExit with a one-line message if the
    model or the drafter cannot be loaded."""
    import specfx
    from specfx.bench.harness import torch_threads

    device = torch.device(args.device)
    with torch_threads(args.threads if device.type == "cpu" else None) as threads:
        model, tok = _load(args)
        try:
            spec = specfx.speculate(
                model, draft=resolve_draft(args.draft), num_speculative_tokens=args.k, compile=not args.no_compile
            )
        except (ValueError, FileNotFoundError) as e:  # an unknown --draft, a head for another model
            raise SystemExit(f"specfx demo: error: {' '.join(str(e).split())}") from None
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        k = "auto" if args.k is None else args.k
        print(
            f"specfx demo: SmolLM2-135M-Instruct ({n_params:.1f} M params, {model.config.num_hidden_layers} layers), "
            f"drafter {spec.method} (K = {k}), {'sampling' if args.sample else 'greedy'}, "
            f"{'eager' if args.no_compile else 'compiled'} rounds, {device}, {model.dtype}, {threads} torch thread(s)"
        )
        prompts = (
            [ChatPrompt("your message", t) for t in args.prompt] if args.prompt else CHAT_PROMPTS[: args.num_prompts]
        )
        ids = [chat_ids(tok, p.text, device) for p in prompts]
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
        if args.sample:
            kw["temperature"] = args.temperature

        def method(generate, **extra):
            def run(x):
                torch.manual_seed(args.seed)  # sampling: every method draws from the same seed
                return generate(x, attention_mask=torch.ones_like(x), **kw, **extra)

            return run

        ks = Counter()  # "auto": how often each K was chosen (per sync window; AutoK.history lasts one call)

        def spec_generate(x, **kwargs):
            out = spec.generate(x, **kwargs)
            ks.update(getattr(spec.auto_k, "history", ()))
            return out

        hf_lookup = f"HF prompt lookup (N={args.prompt_lookup_num_tokens})"
        spec_name = f"specfx {spec.method}"
        methods = {
            "HF generate()": method(model.generate),
            hf_lookup: method(model.generate, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens),
            spec_name: method(spec_generate),
        }

        color = sys.stdout.isatty() and not args.no_color
        on, off = marks(color)
        print(f"\nspecfx's answers, streamed as generated (drafted-and-accepted tokens {on}marked{off}):")
        for i, (prompt, x) in enumerate(zip(prompts, ids, strict=True)):
            print(f"\n--- prompt {i + 1} of {len(prompts)}: {prompt.kind} ---\n{prompt.text}")
            print("--- answer ---", flush=True)
            torch.manual_seed(args.seed)  # specfx's warm-up pass
            spec.generate(x, attention_mask=torch.ones_like(x), streamer=PrintingMarkingStreamer(tok, color), **kw)
        _wait_for_graphs(spec)
        spec.cumulative_stats = type(spec.stats)()  # τ, α and the Ks of the timed passes
        ks.clear()
        times, outputs = _time(methods, ids, args.repeats, warm=[n for n in methods if n != spec_name])

    same = _report(args, len(prompts), ids, times, outputs, spec_name, spec.cumulative_stats, ks)
    return 0 if same or args.sample else 1


def _report(args, n_prompts: int, ids, times: dict, outputs: dict, spec_name: str, stats, ks: Counter) -> bool:
    """Print the speed table, τ, α, the Ks "auto" used and the identical-output check (and write
    the plot if asked); whether specfx's tokens equal HF generate()'s."""
    device = ids[0].device
    new_tokens = {
        name: sum(o.shape[1] - x.shape[1] for o, x in zip(outs, ids, strict=True)) for name, outs in outputs.items()
    }
    speed = {name: new_tokens[name] / statistics.median(times[name]) for name in times}
    ref = outputs["HF generate()"]
    same = {
        name: all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(outs, ref, strict=True))
        for name, outs in outputs.items()
    }
    base = speed["HF generate()"]
    width = max(len(n) for n in times) + 2
    print(
        f"\n{'method':<{width}}{'tokens':>8}{'tokens/s':>10}{'vs HF generate()':>18}{'τ':>7}   same tokens as HF generate()"
    )
    for name in times:
        tau = f"{stats.tokens_per_round:.2f}" if name == spec_name else "-"
        check = (
            "(reference)"
            if name == "HF generate()"
            else ("n/a (sampling)" if args.sample else "yes" if same[name] else "NO")
        )
        print(f"{name:<{width}}{new_tokens[name]:>8}{speed[name]:>10.1f}{speed[name] / base:>17.2f}x{tau:>7}   {check}")
    print(
        f"\nτ (tokens per round) = {stats.tokens_per_round:.2f}, α (acceptance rate) = {stats.acceptance_rate:.2f}, "
        f"{args.repeats} timed pass(es) over {n_prompts} prompt(s), {args.max_new_tokens} new tokens at most"
    )
    if ks:
        total = sum(ks.values())
        print(
            "K chosen by 'auto' (share of sync windows): "
            + ", ".join(f"K={k} {n / total:.0%}" for k, n in sorted(ks.items()))
        )
    if args.sample:
        print(
            f"sampling (temperature {args.temperature}, seed {args.seed}): outputs differ from HF's draw by design; "
            "the distribution is the target's (tests/lossless/test_lossless.py)"
        )
    else:
        print(f"greedy output identical to HF generate(): {'yes' if same[spec_name] else 'NO'}")
    if args.plot is not None:
        from specfx.bench.plot import acceptance_plot

        png = acceptance_plot(
            args.plot, {spec_name: stats.per_position_rate}, speed, f"Speed (SmolLM2-135M-Instruct, {device})"
        )
        if png is not None:
            print(f"plot: {png.resolve()}")
    return same[spec_name]
