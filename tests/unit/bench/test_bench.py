"""``specfx bench``: safe model loading, models left unchanged, tasks, plain help, no tool imports."""

import json
import pickle
import subprocess
import sys

import huggingface_hub
import pytest
import torch
import transformers.utils.hub

from specfx.bench.harness import hf_assisted
from specfx.bench.tasks.default import parse_args, run
from specfx.cli import main
from specfx.model.load import check_model_dir, load_causal_lm
from specfx.testing.tiny import tiny_causal_lm, tiny_pair


# ----------------------------------------------------------------------------- import hygiene
def test_import_specfx_loads_no_tools():
    code = (
        "import sys, specfx; "
        "print([m for m in ('matplotlib', 'specfx.bench', 'specfx.train.pair', 'specfx.cli') if m in sys.modules])"
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


def test_specfx_own_loads_ask_for_no_hub_kernels(tmp_path, no_hub, monkeypatch):
    """Decision 99: transformers 5.25 kernelizes by default (hub kernels on CUDA, fetched over the
    network); specfx's own loaders pass use_kernels=False, which every supported release accepts."""
    from transformers import AutoModelForCausalLM

    from specfx.drafters.pard import from_name

    model = tiny_causal_lm("llama")
    model.config.pard_token = 3  # a PARD checkpoint's mask token, so draft="pard:DIR" loads it
    model.save_pretrained(tmp_path)
    real, seen = AutoModelForCausalLM.from_pretrained, []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_kernels"))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    loaded = [load_causal_lm(tmp_path), from_name(str(tmp_path)).model]
    assert seen == [False, False]
    assert all(not getattr(m, "use_kernels", False) for m in loaded)


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
    argv += ["--lookahead", "3,3,2"]
    assert main(["bench", "drafters", *argv]) == 0
    task = json.loads(out.read_text())["tasks"]["edit"]
    assert set(task["results"]) == {"hf_dynamic", "hf_lookup_k2", "specfx_k2", "specfx_auto", "lookahead_3_3_2"}
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


def test_bench_trees_task_smoke(one_thread, tmp_path, capsys):
    import specfx.bench.tasks.trees as trees

    target, draft = tiny_pair("llama", vocab_size=512)
    out = tmp_path / "trees.json"
    args = trees.parse_args(["--budgets", "1", "8", "--num-prompts", "2", "--calib-prompts", "4", "--holdout-prompts",
                             "3", "--max-new-tokens", "8", "--repeats", "1", "--eager", "--json", str(out)])  # fmt: skip
    assert trees.run(args, target, draft, lambda s: list(s.encode("utf-8")), "tiny pair") == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["budget"], r["shape"]) for r in rows] == [(b, s) for b in (1, 8) for s in trees.SHAPES]
    assert [r["same_as"] for r in rows[:4]] == [None] + ["chain@1"] * 3  # one node: every shape is the chain
    for r in rows:
        assert r["nodes"] == r["budget"] and 1 <= r["depth"] <= r["nodes"]
        assert all(1.0 <= r[k] <= r["depth"] + 1 for k in ("tau_calibration", "tau_holdout", "tau_replay"))
        if r["same_as"] is None:  # run: τ in range, equal to the rank replay, tokens equal HF's
            assert r["status"] == "ok" and 1.0 <= r["tau"] <= r["depth"] + 1
            assert r["tau"] == pytest.approx(r["tau_replay"]) and r["same_tokens_as_hf_dynamic"]
            assert r["tokens_per_s"] > 0 and r["ms_per_round"] > 0
        else:  # the same tree as an earlier shape at this budget: not run again
            same = next(x for x in rows if x["method"] == r["same_as"])
            assert same["budget"] == r["budget"] and same["tree"] == r["tree"] and "tau" not in r
    assert report["baseline"]["status"] == "ok" and report["meta"]["compiled"] is False
    assert (report["meta"]["calibration_functions"], report["meta"]["holdout_functions"]) == (4, 3)
    assert {"per_budget", "goal_speed"} <= set(report["summary"])
    printed = capsys.readouterr().out
    assert "| 8 | search |" in printed and "best tree >= best chain in tokens/s" in printed


def all_trees(n: int, prefix=()) -> list[list[tuple]]:
    """Every tree of ``n`` nodes below ``prefix`` with contiguous child ranks (as node lists)."""
    if n == 0:
        return [[]]
    out = []
    for k in range(1, n + 1):  # the first child's subtree has k nodes, its later siblings n - k
        for below in all_trees(k - 1, prefix + (0,)):
            for rest in all_trees(n - k, prefix):
                shifted = [prefix + (node[len(prefix)] + 1,) + node[len(prefix) + 1 :] for node in rest]
                out.append([prefix + (0,), *below, *shifted])
    return out


def test_tree_search_finds_the_best_small_tree():
    from specfx.bench.tasks.trees import search_tree, simulate
    from specfx.trees.types import TokenTree

    g = torch.Generator().manual_seed(0)
    ranks = [torch.multinomial(torch.tensor([0.6, 0.25, 0.1, 0.05]), 40, True, generator=g).tolist() for _ in range(8)]
    candidates = [TokenTree(nodes) for nodes in all_trees(4)]
    assert len(candidates) == 14 and len(set(candidates)) == 14
    best = max(simulate(t, ranks) for t in candidates)
    found = search_tree(4, ranks)
    assert found.size == 4 and simulate(found, ranks) == pytest.approx(best)


# ----------------------------------------------------------------------------- help and plots
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["bench", "drafters", "--help"],
                                  ["bench", "selfspec", "--help"], ["bench", "trees", "--help"]])  # fmt: skip
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
