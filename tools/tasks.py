"""lm-evaluation-harness tasks on puzzlekit models: `eval --tasks` and `compress --tasks`.

Tasks are loaded one by one before any model runs, so a task whose data cannot be had (a dataset to download on
an offline machine, a data file that is not there) is refused naming it, and the way to run it offline: a task
YAML whose `dataset_path: json` reads `data_files` on disk (or a `save_to_disk` directory), in a folder passed
with --include-path."""
from __future__ import annotations

import functools
import math
import os
import re
from contextlib import contextmanager
from pathlib import Path

from ..errors import UsageError

#: the metrics a table shows per task, in this order when present (others follow)
PREFERRED = ("acc", "acc_norm", "exact_match", "word_perplexity", "byte_perplexity", "bits_per_byte")


def _lm_eval():
    """lm-eval and its task index, refused where missing or older than 0.4.12: tasks are loaded as Task and
    Group objects (`TaskManager.load`), which older versions lack (their `simple_evaluate` also looks every
    task up in the task index it is handed, and this one is handed an empty one: `evaluate_tasks`)."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError("--tasks needs lm-evaluation-harness: pip install 'puzzlekit[eval]'") from None
    if not hasattr(TaskManager, "load"):
        raise UsageError(f"--tasks needs lm-evaluation-harness 0.4.12 or newer (this is "
                         f"{getattr(lm_eval, '__version__', 'an older one')}): pip install -U 'puzzlekit[eval]'")
    return lm_eval, TaskManager


def task_names(text: str) -> list[str]:
    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not names:
        raise UsageError("--tasks: name at least one task (comma-separated), e.g. --tasks arc_easy,hellaswag")
    return names


@functools.lru_cache(maxsize=4)
def _manager(include_path: tuple[str, ...], shipped: bool = True):
    """lm-eval's task index, made once per set of folders: with `shipped`, of every task YAML lm-eval ships too
    (seconds to read), else of the folders' alone (what a run on the user's own tasks needs)."""
    _, TaskManager = _lm_eval()
    return TaskManager(include_path=list(include_path) or None, include_defaults=shipped)


@functools.lru_cache(maxsize=1)
def _shipped_text() -> bytes:
    """The text of every file in lm-eval's task folder, read once (under a second; its index parses them: 5-10 s). Not
    its *.yaml alone: they `include:` files of any name (`_default_template_yaml`), whose `tag:`s are names too."""
    lm_eval, _ = _lm_eval()
    parts = []
    for folder, dirs, files in os.walk(Path(lm_eval.__file__).parent / "tasks"):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        parts += [(Path(folder) / f).read_bytes() for f in sorted(files)]
    return b"\n".join(parts)


def _maybe_shipped(name: str) -> bool:
    """Whether `name` occurs as a word in that text: lm-eval's names are its YAMLs' `task:`, `group:` and `tag:`
    values, so a name found nowhere there is no shipped task (a found one may still not be: the index says)."""
    text, word = _shipped_text(), re.compile(rb"[A-Za-z0-9_]")
    for m in re.finditer(re.escape(name.encode()), text):
        if not (m.start() and word.match(text, m.start() - 1)) and not word.match(text, m.end()):
            return True
    return False


def _load(name: str, manager) -> dict:
    """{name: lm-eval Task or Group} of one task, group or tag (a tag: {each task's name: Task}), which
    simple_evaluate takes back as they are."""
    loaded = manager.load([name])
    top = loaded["groups"].get(name, loaded["tasks"].get(name))  # (not `or`: a Group's truth is its length)
    return {name: top} if top is not None else dict(loaded["tasks"])


def _unknown(name: str, include_path, known: int | None = None) -> UsageError:
    """The refusal of a task name no index holds: a task YAML of --include-path that lm-eval could not read
    (it skips them without a word), else where the names and a task of one's own are."""
    bad = _unreadable_yamls(include_path)
    if bad:
        return UsageError(f"--tasks: unknown task {name!r}, and lm-eval could not read "
                          f"{'a task YAML' if len(bad) == 1 else f'{len(bad)} task YAMLs'} in --include-path: "
                          f"{bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")
    ships = f"lm-eval knows {known:,}" if known is not None else "no task lm-eval ships has that name"
    return UsageError(f"--tasks: unknown task {name!r}; {ships} (lm_eval ls tasks), and a task of your own is a "
                      "YAML file in a folder passed with --include-path")


def _unreadable_yamls(include_path) -> list[str]:
    """'FILE: why' for each task YAML under the --include-path folders that lm-eval cannot read (it skips them
    without a word, so their tasks would be `unknown`)."""
    try:
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # another lm-eval layout: plain YAML
        import yaml

        load_yaml = lambda p, **_: yaml.safe_load(Path(p).read_text())
    bad = []
    for folder in include_path or ():
        for f in sorted(Path(folder).rglob("*.yaml")):
            try:
                load_yaml(f, resolve_func=False, recursive=False)
            except Exception as e:  # yaml's ScannerError, ParserError, ConstructorError; an unreadable file
                bad.append(f"{f}: {' '.join(str(e).split())[:240]}")
    return bad


def load_tasks(names: list[str], include_path=None) -> dict:
    """{name: lm-eval task or group} for each name, its data read now: a task that cannot be loaded is refused
    with one line naming it (a task YAML that cannot be read names the file and its error; a missing
    --include-path folder is named). Each call builds fresh task objects (they hold one evaluation's requests);
    their data files become inputs of the command (no output may replace them)."""
    _lm_eval()  # refused at once without lm-eval
    for folder in include_path or ():
        if not Path(folder).is_dir():
            raise UsageError(f"--include-path {folder}: no such folder (it should hold your task YAML files)")
    folders = tuple(str(p) for p in include_path or ())
    manager = _manager(folders, shipped=False) if folders else None
    missing = [n for n in names if manager is None or n not in manager.all_tasks]
    for name in missing:  # a name in no file lm-eval ships is refused before its whole index is read
        if not _maybe_shipped(name):
            raise _unknown(name, include_path)
    if missing:  # a shipped task among them: the whole index
        manager = _manager(folders)
    known = set(manager.all_tasks)
    out = {}
    for name in names:
        if name not in known:
            raise _unknown(name, include_path, len(known))
        try:
            try:
                out.update(_load(name, manager))
            except Exception:  # a group of the folders' that names a shipped task: again with the whole index
                if manager is _manager(folders):
                    raise
                out.update(_load(name, _manager(folders)))
        except Exception as e:  # datasets raises ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
            first = str(e).splitlines()[0] if str(e) else ""
            raise UsageError(f"task {name}: its data could not be loaded ({type(e).__name__}: {first[:200]}); on a "
                             "machine without the network, put the data on disk and write a task YAML that reads it "
                             "(dataset_path: json with data_files, or a save_to_disk directory), then pass its "
                             "folder with --include-path") from None
    from ..outputs import declare

    declare((p, f"task data ({task})") for task, p in task_files(out))
    return out


def leaf_tasks(tasks: dict):
    """(name, lm-eval Task) of every task in a task dict, groups opened."""
    for key, value in tasks.items():
        if isinstance(value, dict):
            yield from leaf_tasks(value)
        elif hasattr(value, "get_all_tasks"):  # a Group
            yield from ((t.config.task, t) for t in value.get_all_tasks())
        elif value is not None and hasattr(value, "config"):
            yield getattr(key, "group_name", None) or getattr(value.config, "task", None) or str(key), value


def task_files(tasks: dict):
    """(task, path) of the files on disk each task reads its data from (dataset_kwargs' data_files, a local
    dataset_path)."""
    for name, task in leaf_tasks(tasks):
        cfg = task.config
        kwargs = getattr(cfg, "dataset_kwargs", None) or {}
        files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
        found = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else files or []
        found += [getattr(cfg, "dataset_path", None) or ""]
        for f in found:
            for p in [f] if isinstance(f, str) else f:
                if isinstance(p, str) and p and Path(p).exists():
                    yield name, p


def check_task_options(tasks: dict, num_fewshot: int | None) -> None:
    """Before any model runs: refuses a few-shot count a task cannot draw (lm-eval itself fails deep inside with
    `Sample larger than population`): its few-shot documents, less the one being asked when they are the
    evaluated documents themselves."""
    for name, task in leaf_tasks(tasks):
        k = num_fewshot if num_fewshot is not None else (getattr(task.config, "num_fewshot", None) or 0)
        if not k:
            continue
        pool = task.fewshot_docs()
        docs = task.eval_docs
        same = pool is not None and len(pool) == len(docs) and (len(pool) == 0 or pool[0] == docs[0])
        have = 0 if pool is None else len(pool) - (1 if same else 0)
        if k > have:
            raise UsageError(f"--num-fewshot {k}: task {name} has {have:,} documents to draw examples from"
                             f"{' (its evaluated documents, less the one asked)' if same else ''}; give at most "
                             f"--num-fewshot {have}")


@contextmanager
def without_environment_report():
    """simple_evaluate without the environment it appends to its results (torch's collect_env: `pip list`,
    `nvidia-smi`, `lscpu`, compilers and `git describe`, a dozen processes and 1-2 s per call), which no
    puzzlekit report reads: only the scores are kept."""
    from lm_eval import evaluator

    stubs = {"add_env_info": lambda storage: None, "get_git_commit_hash": lambda: None}
    saved = {k: getattr(evaluator, k) for k in stubs if hasattr(evaluator, k)}  # (what this lm-eval has)
    for k in saved:
        setattr(evaluator, k, stubs[k])
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(evaluator, k, v)


def evaluate_tasks(model, tasks: dict, limit=None, num_fewshot=None, batch_size: int = 8) -> dict:
    """{task: {metric: (value, standard error or None)}} of an lm-eval model (a PuzzlekitLM) on loaded tasks.
    The tasks are loaded already, so simple_evaluate gets an empty task index: without one it reads every task YAML
    lm-eval ships (5-10 s a call) to look up nothing."""
    import logging

    lm_eval, _ = _lm_eval()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-metric defaults, said for every task YAML
    with without_environment_report():
        res = lm_eval.simple_evaluate(model=model, tasks=list(tasks.values()), task_manager=_manager((), shipped=False),
                                      limit=limit, num_fewshot=num_fewshot,
                                      batch_size=batch_size, log_samples=False, bootstrap_iters=1000,
                                      random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    out = {}
    for task, metrics in res["results"].items():
        row = {}
        for key, v in metrics.items():
            name, _, filt = key.partition(",")
            if not filt or name.endswith("_stderr") or not isinstance(v, (int, float)):
                continue
            err = metrics.get(f"{name}_stderr,{filt}")
            row[name] = (float(v), float(err) if isinstance(err, (int, float)) and math.isfinite(err) else None)
        out[task] = dict(sorted(row.items(), key=lambda kv: (PREFERRED.index(kv[0]) if kv[0] in PREFERRED
                                                                 else len(PREFERRED), kv[0])))
    return out


def model_for(prog, compute, batch_size: int = 8):
    """The lm-eval model of a loaded program (registered as `puzzlekit` by this import)."""
    _lm_eval()
    from ..evaluation.lm_eval_model import PuzzlekitLM

    return PuzzlekitLM(program=prog, compute=compute, batch_size=batch_size)


def rows(scores: dict, teacher: dict | None = None) -> list[dict]:
    """One row per (task, metric): the value, its standard error, and with a teacher its value and the difference."""
    out = []
    for task, metrics in scores.items():
        for metric, (value, err) in metrics.items():
            row = {"task": task, "metric": metric, "value": value, "stderr": err}
            if teacher is not None and metric in teacher.get(task, {}):
                row |= {"teacher": teacher[task][metric][0], "difference": value - teacher[task][metric][0]}
            out.append(row)
    return out


def table(rows_: list[dict]) -> str:
    from ..ir.printer import format_table

    teacher = any("teacher" in r for r in rows_)
    head = ("task", "metric", "value", "± stderr") + (("teacher", "difference") if teacher else ())
    f = lambda v: "-" if v is None else f"{v:.4f}"
    return format_table([head] + [(r["task"], r["metric"], f(r["value"]), f(r["stderr"]))
                                  + ((f(r.get("teacher")), f"{r['difference']:+.4f}" if "difference" in r else "-")
                                     if teacher else ()) for r in rows_])


def eval_command(args) -> int:
    """`puzzlekit eval MODEL --tasks T1,T2 [--teacher T]`: the tasks' metrics, and the teacher's beside them."""
    from .. import ir
    from ..text.tokenizer import check_shared, set_tokenizer
    from .common import compute_of, emit, load_model
    from .default_model import model_path

    names = task_names(args.tasks)
    tasks = load_tasks(names, args.include_path)  # every task's data first: refused before a model is read
    check_task_options(tasks, args.num_fewshot)
    compute = compute_of(args)
    prog = ir.verify(load_model(args, text=True))
    teacher = None
    if args.teacher:
        teacher = ir.verify(ir.load(model_path(args.teacher)))
        set_tokenizer(teacher, args.tokenizer)
        check_shared(prog, teacher)
    run = lambda p, t: evaluate_tasks(model_for(p, compute, args.batch_size), t, args.limit, args.num_fewshot,
                                      args.batch_size)
    scores = run(prog, tasks)  # the teacher's evaluation needs task objects of its own (they hold the requests)
    found = rows(scores, run(teacher, load_tasks(names, args.include_path)) if teacher is not None else None)
    emit(args, {"model": str(model_path(args.model)), "teacher": args.teacher, "tasks": names, "limit": args.limit,
                "num_fewshot": args.num_fewshot, "rows": found}, table(found))
    return 0
