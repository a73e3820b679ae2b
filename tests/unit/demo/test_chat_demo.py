"""``specfx demo``, the default: SmolLM2-135M-Instruct through its chat template
(:mod:`specfx.demo.chat`).

The argument parsing and the drafter names need no model. The prompt rendering and the end-to-end
run use the real model from the user's cache (``smollm2_dir()``); they skip, saying why, only
where it is not converted there and cannot be made (no ``gguf`` package, or no network to fetch
the GGUF), as tests/unit/demo/test_smollm2.py's full tier decides.
"""

import subprocess
import sys

import pytest
import torch

from specfx import cli
from specfx.demo import chat, pair_demo, smollm2
from specfx.demo.pair import DEMO_PAIR_DIR
from tests.unit.demo.test_smollm2 import offline  # noqa: F401 (a fixture: no model, no network)


@pytest.fixture
def ran(monkeypatch):
    """Run ``specfx demo`` with the two demos replaced by recorders: the args each got."""
    calls = []
    monkeypatch.setattr(chat, "run_chat", lambda args: calls.append(("chat", args)) or 0)
    monkeypatch.setattr(pair_demo, "run_pair", lambda args: calls.append(("pair", args)) or 0)

    def run(*argv):
        assert cli.main(["demo", *argv]) == 0
        assert len(calls) == 1
        return calls.pop()

    return run


# ---- arguments


def test_the_default_is_the_chat_model_with_its_defaults(ran):
    which, args = ran()
    assert which == "chat"
    assert (args.max_new_tokens, args.num_prompts, args.repeats, args.threads) == (128, 4, 2, 1)
    assert args.k is None and args.draft is None  # "auto" K, the default drafter
    assert args.gguf is None and args.plot is None
    assert args.prompt_lookup_num_tokens == 10 and args.temperature == 0.7 and not args.sample and not args.no_compile


def test_chat_options(ran, tmp_path):
    which, args = ran(
        "--prompt", "Hi", "--prompt", "Bye", "--gguf", str(tmp_path / "m.gguf"), "--draft", "lookahead",
        "--k", "3", "--max-new-tokens", "16", "--no-compile", "--sample", "--threads", "2",
    )  # fmt: skip
    assert which == "chat"
    assert args.prompt == ["Hi", "Bye"] and args.gguf == str(tmp_path / "m.gguf") and args.draft == "lookahead"
    assert (args.k, args.max_new_tokens, args.threads) == (3, 16, 2) and args.no_compile and args.sample


def test_pair_keeps_its_own_defaults(ran, tmp_path):
    which, args = ran("--pair")
    assert which == "pair"
    assert (args.k, args.draft, args.max_new_tokens, args.num_prompts, args.temperature) == (4, "draft", 64, 3, 0.8)
    assert args.plot == pair_demo.PAIR_DEFAULTS["plot"]
    plot = str(tmp_path / "p.png")
    _, args = ran("--pair", "--draft", "medusa", "--k", "2", "--sample", "--no-compile", "--plot", plot)
    assert (args.draft, args.k, args.sample, args.no_compile) == ("medusa", 2, True, True)
    assert str(args.plot) == plot


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pair", "--gguf", "x.gguf"], "--gguf is for the SmolLM2 demo, not --pair"),
        (["--pair", "--draft", "lookahead"], "--pair: --draft takes one of draft, eagle3, eagle, medusa"),
        (["--draft", "medusa"], "drafts for the shipped pair: add --pair"),  # eagle3: SmolLM2's own head
        (["--num-prompts", "5"], "there are 4 built-in prompts"),
        (["--prompt-lookup-num-tokens", "0"], "must be >= 1"),
        (["--repeats", "0"], "must be >= 1"),
    ],
)
def test_bad_demo_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ---- drafters


def test_draft_names_and_head_directories():
    assert chat.resolve_draft(None) is None  # speculate()'s default: prompt lookup for SmolLM2
    assert chat.resolve_draft("prompt_lookup") == "prompt_lookup"
    assert chat.resolve_draft("lookahead") == "lookahead"
    heads = DEMO_PAIR_DIR / "heads"
    for kind in ("eagle3", "eagle", "medusa"):
        assert chat.head_kind(heads / kind) == kind  # read from the public layouts' config.json
        assert chat.resolve_draft(str(heads / kind)) == f"{kind}:{heads / kind}"
        assert chat.resolve_draft(f"{kind}:somewhere") == f"{kind}:somewhere"  # named: passed on as is
    assert chat.resolve_draft("eagle3") == f"eagle3:{smollm2.SMOLLM2_EAGLE3_DIR}"  # the shipped head
    with pytest.raises(ValueError, match="neither prompt_lookup nor lookahead nor eagle3 nor a head directory"):
        chat.resolve_draft("ngram")


def test_a_directory_that_is_no_known_head_asks_for_its_kind(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="--draft eagle3:"):
        chat.resolve_draft(str(tmp_path))


def test_built_in_prompts_are_of_several_kinds():
    kinds = [p.kind for p in chat.CHAT_PROMPTS]
    assert len(kinds) == chat.CHAT_DEFAULTS["num_prompts"] == len(set(kinds)) >= 3
    assert "```python" in chat.CHAT_PROMPTS[2].text  # the code edit carries its snippet


# ---- the model missing


def test_a_missing_gguf_fails_with_how_to_fix_it():
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--gguf", "/nonexistent/SmolLM2.gguf", "--no-compile"])
    message = str(e.value.code)
    assert message.startswith("specfx demo: error: ") and "\n" not in message
    assert "/nonexistent/SmolLM2.gguf" in message and "does not exist" in message
    assert "--gguf PATH" in message and smollm2.GGUF_ENV in message and "specfx demo --pair" in message


@pytest.mark.usefixtures("offline")
def test_offline_without_the_model_says_how_to_fix_it():
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--no-compile"])
    message = str(e.value.code)
    assert message.startswith("specfx demo: error: ") and "\n" not in message
    assert "offline?" in message and "--gguf PATH" in message


def test_the_command_prints_one_line_and_no_traceback():
    command = [sys.executable, "-m", "specfx.cli", "demo", "--gguf", "/nonexistent/SmolLM2.gguf"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("specfx demo: error: ")


# ---- the real model


@pytest.fixture(scope="module")
def smollm2_directory():
    try:
        return smollm2.smollm2_dir()  # the cache; else fetched and converted, as users get it
    except (RuntimeError, FileNotFoundError, ImportError) as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not converted in the cache and cannot be made here: {e}")


def test_prompts_are_rendered_by_the_chat_template(smollm2_directory):
    from specfx.model.load import load_tokenizer

    tok = load_tokenizer(smollm2_directory)
    for prompt in chat.CHAT_PROMPTS:
        ids = chat.chat_ids(tok, prompt.text)
        assert ids.dtype == torch.long and ids.dim() == 2 and ids.shape[0] == 1
        messages = [{"role": "user", "content": prompt.text}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert f"<|im_start|>user\n{prompt.text}<|im_end|>" in rendered
        assert rendered.endswith("<|im_start|>assistant\n")  # the answer comes next
        assert tok.decode(ids[0]) == rendered
        assert ids[0, -1].item() != tok.eos_token_id


def test_demo_end_to_end(smollm2_directory, one_thread, capsys):
    argv = ["demo", "--no-compile", "--max-new-tokens", "8", "--num-prompts", "1", "--repeats", "1", "--no-color"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "drafter prompt_lookup (K = auto)" in out
    assert "eager rounds, cpu, torch.float32, 1 torch thread(s)" in out  # what the speed depends on
    assert "--- prompt 1 of 1: code writing ---" in out and "--- answer ---" in out
    table = out[out.index("\nmethod") + 1 :].splitlines()
    rows = {line.split("  ")[0]: line for line in table[1:4]}
    assert set(rows) == {"HF generate()", "HF prompt lookup (N=10)", "specfx prompt_lookup"}
    assert rows["specfx prompt_lookup"].endswith("yes") and rows["HF prompt lookup (N=10)"].endswith("yes")
    assert "greedy output identical to HF generate(): yes" in out
    assert "τ (tokens per round) = " in out
    answer = out[out.index("--- answer ---\n") + 15 : out.index("\nmethod")].strip()
    assert answer.replace("«", "").replace("»", "")  # streamed: the answer's text is there
