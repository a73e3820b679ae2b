"""``specfx bench``: safe model loading, models left unchanged, tasks, plain help, no tool imports."""

import json
import pickle
import subprocess
import sys

import huggingface_hub
import pytest
import torch
import transformers.utils.hub

from specfx.bench.common import hf_assisted
from specfx.bench.core import parse_args, run
from specfx.cli import main
from specfx.models.local import check_model_dir, load_causal_lm
from specfx.models.tiny import tiny_causal_lm, tiny_pair


# ----------------------------------------------------------------------------- import hygiene
def test_import_specfx_loads_no_tools():
    code = (
        "import sys, specfx; "
        "print([m for m in ('matplotlib', 'specfx.bench', 'specfx.models.train_pair', 'specfx.cli') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- local loading
class Explodes:
    """Unpickling this object raises: a stand-in for a pickle that runs code when loaded."""

    def __reduce__(self):
        return (exec, ("raise RuntimeError('the pickle was loaded')",))


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach a hub fails the test at once."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a hub download was attempted: {args} {kwargs}")

    for module in (huggingface_hub, huggingface_hub.file_download, transformers.utils.hub):
        for name in ("hf_hub_download", "snapshot_download", "model_info", "list_repo_files"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)


@pytest.fixture
def pickle_only_dir(tmp_path, monkeypatch):
    """A model directory whose only weights are a pytorch_model.bin; torch.load is booby-trapped."""
    tiny_causal_lm("llama").config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Explodes()))

    def trap(*args, **kwargs):
        raise AssertionError("torch.load was called on the pickle")

    monkeypatch.setattr(torch, "load", trap)
    return tmp_path


def test_pickle_weights_are_refused_unread(pickle_only_dir, no_hub):
    with pytest.raises(ValueError, match=r"no safetensors weights.*pytorch_model\.bin \(pickle\)"):
        load_causal_lm(pickle_only_dir)


def test_bench_refuses_pickle_weights_with_a_message(pickle_only_dir, no_hub, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", str(pickle_only_dir), "--no-compile"])
    assert "no safetensors weights" in str(e.value.code) and "save_pretrained" in str(e.value.code)


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_bench_refuses_a_missing_path_without_a_network_attempt(flag, no_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["bench", flag, "no-such-model", "--no-compile"])
    assert "'no-such-model' is not an existing local directory" in str(e.value.code)


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_dir(tmp_path)


def test_a_safetensors_directory_loads_offline(tmp_path, no_hub):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(tmp_path)
    assert not loaded.training
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- models unchanged
def test_hf_assisted_sets_k_only_during_the_call():
    target, draft = tiny_pair("llama")
    before = draft.generation_config.to_dict()
    with hf_assisted(target, draft, 3) as kw:
        assert kw == {"assistant_model": draft}
        assert draft.generation_config.num_assistant_tokens == 3
        assert draft.generation_config.num_assistant_tokens_schedule == "constant"
    assert draft.generation_config.to_dict() == before
    with hf_assisted(target, "early_exit:1", 5) as kw:  # HF's early exit reads the target's config
        assert kw == {"assistant_early_exit": 1} and target.generation_config.num_assistant_tokens == 5
    assert target.generation_config.num_assistant_tokens != 5


def test_bench_leaves_the_models_generation_config_unchanged(one_thread, tmp_path, capsys):
    target, draft = tiny_pair("llama")
    for m in (target, draft):
        m.generation_config.eos_token_id = 2  # a real EOS, which the bench must disable per call only
    before = [m.generation_config.to_dict() for m in (target, draft)]
    args = parse_args(["--no-compile", "--k", "2", "--max-new-tokens", "4", "--num-prompts", "1", "--repeats", "1"])
    args.out, args.skip_set = tmp_path, {"hf_static"}
    assert run(args, target, draft, None, "tiny pair") == 0
    assert [m.generation_config.to_dict() for m in (target, draft)] == before
    runs = json.loads((tmp_path / "bench.json").read_text())["runs"]["1"]
    assert runs["hf_assisted@2"]["status"] == "ok" and runs["specfx_eager@2"]["same_tokens_as_hf_dynamic"]
    assert "1 torch thread(s)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the other tasks
def test_bench_drafters_task_smoke(one_thread, tmp_path, capsys):
    out = tmp_path / "drafters.json"
    argv = ["--target", "random", "--tasks", "edit", "--num-prompts", "1", "--max-new-tokens", "4"]
    argv += ["--ks", "2", "--auto-values", "1", "2", "--repeats", "1", "--no-compile", "--json", str(out)]
    assert main(["bench", "drafters", *argv]) == 0
    task = json.loads(out.read_text())["tasks"]["edit"]
    assert set(task["results"]) == {"hf_dynamic", "hf_lookup_k2", "specfx_k2", "specfx_auto"}
    assert all(r["same_tokens_as_hf_dynamic"] for r in task["results"].values())
    assert "| specfx_k2 |" in capsys.readouterr().out


def test_bench_selfspec_task_smoke(one_thread, tmp_path, capsys):
    out = tmp_path / "selfspec.json"
    argv = ["--target", "random", "--families", "early_exit", "--exit-layers", "2", "--k", "2", "--num-prompts", "1"]
    argv += ["--max-new-tokens", "4", "--repeats", "1", "--no-compile", "--json", str(out)]
    assert main(["bench", "selfspec", *argv]) == 0
    results = json.loads(out.read_text())["families"]["early_exit"]["results"]
    assert set(results) == {"hf_dynamic", "hf_early_exit_n2", "specfx_early_exit_n2"}
    assert all(r["status"] == "ok" and r["same_tokens_as_hf_dynamic"] for r in results.values())


# ----------------------------------------------------------------------------- help and plots
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["bench", "drafters", "--help"],
                                  ["bench", "selfspec", "--help"]])  # fmt: skip
def test_help_is_plain_text(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: specfx" in out
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:"):
        assert markup not in out


def test_bench_help_mentions_threads_and_tasks(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--threads" in out and "specfx bench drafters" in out and "specfx bench selfspec" in out


def test_missing_matplotlib_skips_the_plot_with_an_install_hint(monkeypatch, tmp_path, capsys):
    from specfx.bench.plot import acceptance_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert acceptance_plot(tmp_path / "x.png", {}, {"a": 1.0}, "t") is None
    assert not (tmp_path / "x.png").exists()
    assert 'pip install "specfx[plot]"' in capsys.readouterr().err
