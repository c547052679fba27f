"""lm-evaluation-harness tasks on puzzlekit models (`puzzlekit` lm-eval model, `eval --tasks`).

Oracles: lm-eval's own `hf` model (transformers' NemotronH) on the same checkpoint, scoring the same task files
(multiple choice, rolling log-likelihood, greedy generation with a stop string); and, for the built-in byte
model, each request scored alone by an unbatched forward."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from puzzlekit import ir  # noqa: E402
from puzzlekit.backends.torch import materialize  # noqa: E402
from puzzlekit.tools.cli import main  # noqa: E402
from puzzlekit.tools.tasks import without_environment_report  # noqa: E402

import puzzlekit.evaluation.lm_eval_model  # noqa: E402,F401  (registers "puzzlekit")
from lm_eval.tasks import TaskManager  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[1] / "tools" / "default-model"
TOL = 1e-4


@pytest.fixture(scope="module")
def tasks_dir(local_tasks):
    return local_tasks


@functools.lru_cache(maxsize=1)
def _manager(tasks_dir) -> TaskManager:
    return TaskManager(include_path=str(tasks_dir), include_defaults=False)  # the folder's tasks alone


def _run(model, model_args, tasks_dir, tasks=("pk_mc", "pk_ppl", "pk_gen"), batch_size=4):
    with without_environment_report():  # the scores alone: no `pip list` and the like per run
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                       task_manager=_manager(tasks_dir), log_samples=True,
                                       batch_size=batch_size, bootstrap_iters=0)


def _samples(res, task) -> list:
    return [s["filtered_resps"] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def both(subword, tasks_dir):
    """(puzzlekit's results, lm-eval's hf model's results) on the subword checkpoint, float32 on CPU."""
    args = f"pretrained={subword.model},dtype=float32,device=cpu"
    return _run("puzzlekit", args, tasks_dir), _run("hf", args, tasks_dir, batch_size=1)


def test_multiple_choice_loglikelihoods_equal_the_hf_models(both):
    ours, theirs = both
    a, b = _samples(ours, "pk_mc"), _samples(theirs, "pk_mc")
    assert len(a) == len(b) == 12
    for mine, hf in zip(a, b):
        assert [g for _, g in mine] == [g for _, g in hf]
        for (x, _), (y, _) in zip(mine, hf):
            assert abs(float(x) - float(y)) <= TOL * max(1.0, abs(float(y))), (mine, hf)
    assert ours["results"]["pk_mc"]["acc,none"] == theirs["results"]["pk_mc"]["acc,none"]
    assert len({round(float(x), 3) for s in a for x, _ in s}) > 12  # real, differing scores


def test_rolling_loglikelihood_equals_the_hf_models(both):
    ours, theirs = both
    for mine, hf in zip(_samples(ours, "pk_ppl"), _samples(theirs, "pk_ppl")):
        assert abs(float(mine[0]) - float(hf[0])) <= TOL * abs(float(hf[0]))
    assert ours["results"]["pk_ppl"]["bits_per_byte,none"] == \
        pytest.approx(theirs["results"]["pk_ppl"]["bits_per_byte,none"], rel=TOL)


def test_generation_equals_the_hf_models_greedy_output(both):
    ours, theirs = both
    a, b = _samples(ours, "pk_gen"), _samples(theirs, "pk_gen")
    assert a == b and any(x[0] for x in a)  # something was generated, cut at the stop string
    assert all("\n" not in x[0] for x in a)


def test_a_published_child_evaluates_through_its_own_code_in_hf_too(subword, tasks_dir, tmp_path):
    """The hf model loads a child saved by puzzlekit (trust_remote_code): the two agree on it as well."""
    prog = ir.load(subword.model)
    ir.save(prog, tmp_path / "child")
    args = f"pretrained={tmp_path / 'child'},dtype=float32,device=cpu"
    ours = _run("puzzlekit", args, tasks_dir, tasks=("pk_mc",))
    theirs = _run("hf", args + ",trust_remote_code=True", tasks_dir, tasks=("pk_mc",), batch_size=1)
    for mine, hf in zip(_samples(ours, "pk_mc"), _samples(theirs, "pk_mc")):
        assert [float(x) for x, _ in mine] == pytest.approx([float(y) for y, _ in hf], rel=TOL)


def test_the_byte_model_scores_each_request_as_an_unbatched_forward_does(tasks_dir):
    """Batching (long first, right padding) changes nothing: each continuation's log-likelihood equals one
    forward over that request alone."""
    res = _run("puzzlekit", f"pretrained={DEFAULT}", tasks_dir, tasks=("pk_mc",))
    m = materialize(ir.load(DEFAULT))
    for s in sorted(res["samples"]["pk_mc"], key=lambda s: s["doc_id"])[:6]:
        for (context, continuation), (got, _) in zip([r for r in s["arguments"]], s["filtered_resps"]):
            ctx, cont = list(context.encode()), list(continuation.encode())
            with torch.no_grad():
                logits = m(torch.tensor([ctx + cont[:-1]]))[0][0]
            want = torch.log_softmax(logits.float(), -1)[len(ctx) - 1:].gather(-1, torch.tensor(cont)[:, None]).sum()
            assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-4)


def test_task_scores_come_without_lm_evals_environment_report(tasks_dir, monkeypatch):
    """`eval --tasks` keeps lm-eval's scores alone: the environment report simple_evaluate appends (torch's
    collect_env: `pip list`, `nvidia-smi`, ...; `git describe`), a dozen processes per call, is not collected,
    and lm-eval's own functions are back in place afterwards. Nor is the index of every task lm-eval ships read
    (5-10 s) for tasks of the user's own folder, loaded already."""
    import subprocess

    from lm_eval import evaluator
    from torch.utils import collect_env

    from puzzlekit.backends.torch.device import resolve
    from puzzlekit.tools.tasks import evaluate_tasks, load_tasks, model_for

    started, popen = [], subprocess.Popen.__init__
    monkeypatch.setattr(subprocess.Popen, "__init__", lambda self, args, *a, **k: started.append(args) or popen(
        self, args, *a, **k))
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: started.append("collect_env") or "")
    indexes, index = [], TaskManager.__init__
    monkeypatch.setattr(TaskManager, "__init__", lambda self, *a, **k: indexes.append(k.get("include_defaults", True))
                        or index(self, *a, **k))
    before = (evaluator.add_env_info, evaluator.get_git_commit_hash)
    scores = evaluate_tasks(model_for(ir.load(DEFAULT), resolve("cpu")), load_tasks(["pk_mc"], [str(tasks_dir)]),
                            limit=2)
    assert 0 <= scores["pk_mc"]["acc"][0] <= 1
    assert not [a for a in started if "ldconfig" not in str(a)], started  # (ctypes' library lookups aside)
    assert (evaluator.add_env_info, evaluator.get_git_commit_hash) == before
    assert True not in indexes, "lm-eval's shipped task index was read"


def test_eval_tasks_prints_the_table_and_json(subword, tasks_dir, capsys):
    assert main(["eval", str(subword.model), "--tasks", "pk_mc,pk_ppl", "--include-path", str(tasks_dir),
                 "--limit", "6", "--teacher", str(subword.model), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["task"], r["metric"]): r for r in out["rows"]}
    assert set(rows) >= {("pk_mc", "acc"), ("pk_ppl", "word_perplexity"), ("pk_ppl", "bits_per_byte")}
    assert all(r["difference"] == 0 for r in rows.values())  # the model is its own teacher
    assert rows[("pk_mc", "acc")]["stderr"] is not None
    assert main(["eval", str(subword.model), "--tasks", "pk_mc", "--include-path", str(tasks_dir), "--limit",
                 "4"]) == 0
    text = capsys.readouterr().out
    assert "pk_mc" in text and "acc" in text and "± stderr" in text


def test_a_group_scores_its_tasks_as_they_score_alone_and_their_aggregate(subword, tasks_dir, tmp_path, capsys):
    """A group (lm-eval's mmlu is one) through `eval --tasks`: each of its tasks scores what it scores alone, the
    group row is their size-weighted mean, and the group's task files are inputs like a task's."""
    import shutil

    folder = tmp_path / "tasks"
    shutil.copytree(tasks_dir, folder)
    (folder / "group.yaml").write_text("group: pk_group\ntask:\n  - pk_mc\n  - pk_ppl\naggregate_metric_list:\n"
                                       "  - metric: acc\n    weight_by_size: true\n")
    args = ["eval", str(subword.model), "--include-path", str(folder), "--limit", "6", "--json"]
    assert main([*args, "--tasks", "pk_group"]) == 0
    grouped = {(r["task"], r["metric"]): r["value"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main([*args, "--tasks", "pk_mc,pk_ppl"]) == 0
    alone = {(r["task"], r["metric"]): r["value"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert {k: v for k, v in grouped.items() if k[0] != "pk_group"} == alone
    assert grouped[("pk_group", "acc")] == pytest.approx(alone[("pk_mc", "acc")], rel=1e-12)  # acc: pk_mc's alone
    from puzzlekit.tools.tasks import load_tasks, task_files

    assert sorted(t for t, _ in task_files(load_tasks(["pk_group"], [str(folder)]))) == ["pk_mc", "pk_ppl"]


def test_an_unknown_task_is_named_with_the_fix_without_reading_every_shipped_task(tasks_dir, monkeypatch, capsys):
    """A name in no file lm-eval ships is refused before its whole index is built (5-10 s)."""
    from puzzlekit.tools import tasks

    made, real = [], tasks._manager

    def spy(folders, shipped=True):
        made.append(shipped)
        return real(folders, shipped)

    monkeypatch.setattr(tasks, "_manager", spy)
    for args in (["--include-path", str(tasks_dir)], []):
        assert main(["eval", "--tasks", "no_such_task_anywhere", *args]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "'no_such_task_anywhere'" in line and "lm_eval ls tasks" in line and "--include-path" in line
    assert True not in made


def test_an_lm_eval_without_task_objects_is_refused_naming_the_version_and_the_fix(tasks_dir, monkeypatch, capsys):
    """lm-eval before 0.4.12 has no TaskManager.load, and its simple_evaluate looks every task up in the task index
    it is handed (an empty one here): a KeyError after the model was loaded. Refused at once instead."""
    monkeypatch.delattr(lm_eval.tasks.TaskManager, "load")
    assert main(["eval", "--tasks", "pk_mc", "--include-path", str(tasks_dir)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "0.4.12 or newer" in line and "pip install -U 'puzzlekit[eval]'" in line, line


@pytest.mark.parametrize("where, key, name", [
    ("hellaswag/hellaswag.yaml", "task", "hellaswag"), ("arc/arc_easy.yaml", "task", "arc_easy"),
    ("mmlu/default/_mmlu.yaml", "group", "mmlu"),
    ("tydiqa/_tydiqa_goldp_common_yaml", "tag", "tydiqa_goldp")])  # a tag in an included file not named *.yaml
def test_the_text_scan_keeps_every_shipped_name(where, key, name):
    """Oracle: the name is that key's value in lm-eval's own file (its index takes seconds); a part of a name is
    none."""
    from lm_eval.tasks._yaml_loader import load_yaml
    from puzzlekit.tools.tasks import _maybe_shipped

    assert load_yaml(Path(lm_eval.__file__).parent / "tasks" / where, resolve_func=False, recursive=False)[key] == name
    assert _maybe_shipped(name)
    assert not any(map(_maybe_shipped, ("ellaswag", "hellaswa", "arc_eas", "no_such_task_anywhere")))


@pytest.mark.slow  # a fresh interpreter indexes every lm-eval task: 15 s
def test_a_task_whose_data_must_be_downloaded_offline_fails_in_one_line(tasks_dir, tmp_path):
    (tmp_path / "remote.yaml").write_text("task: pk_remote\ndataset_path: someone/some_dataset\ntest_split: test\n"
                                          "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: [a, b]\n"
                                          "doc_to_target: 0\n")
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-m", "puzzlekit.tools", "eval", "--tasks", "pk_remote", "--include-path",
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "task pk_remote" in last and "--include-path" in last, r.stderr[-2000:]
