"""The user's own data and files: any reasonable corpus works, `eval --data` scores the file it is
given, nothing the user owns is touched, and every bad input is one clear line (exit 2, no traceback, no
`unexpected`) with the user's files unchanged (hashed before and after).

Oracles: transformers' NemotronH and tokenizer on the same documents (conftest's `subword`), the stdlib source the
data is made of, lm-eval's `hf` model's own rules (continuations longer than the context, BOS/EOS)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from puzzlekit.text import data as pk_data  # noqa: E402
from puzzlekit.text.data import HELD_OUT, stdlib_files  # noqa: E402
from puzzlekit.tools.cli import main  # noqa: E402


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pk_data, "_CORPORA", {})


def run(capsys, *args) -> tuple[int, str, str]:
    """main(args) -> (exit code, stdout, stderr); a refusal is one line, never a traceback or `unexpected`."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "unexpected" not in err, err
    return code, out, err


def refused(capsys, *args) -> str:
    code, _, err = run(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.startswith("puzzlekit")]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def sha(*paths) -> dict:
    out = {}
    for path in map(Path, paths):
        for f in (sorted(path.rglob("*")) if path.is_dir() else [path]):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _model_copy(subword, d: Path, template: str | None = None) -> Path:
    shutil.copytree(subword.model, d)
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


@pytest.fixture(scope="module")
def sixty(tmp_path_factory) -> Path:
    """A plain corpus: 60 Python source files of the standard library, each truncated to 6 KB, one
    {"text": ...} per line."""
    files = [f for f in stdlib_files() if f.stat().st_size > 1000][:60]
    out = tmp_path_factory.mktemp("sixty") / "docs.jsonl"
    out.write_text("".join(json.dumps({"text": f.read_text(errors="replace")[:6000]}) + "\n" for f in files))
    return out


# -- 1, 2: a held-out split that works; eval --data scores the whole file ------------------------------------------------
def test_eval_data_scores_the_whole_file_as_transformers_does(subword, sixty, capsys):
    before = sha(sixty, subword.model)
    code, out, err = run(capsys, "eval", subword.model, "--data", sixty, "--prompts", "1", "--new-tokens", "3",
                         "--json")
    assert code == 0, err
    res = json.loads(out)
    texts = [json.loads(line)["text"] for line in sixty.read_text().splitlines()]
    tok, nll, tokens = subword.tokenizer, 0.0, 0
    with torch.no_grad():  # the oracle: each document alone, BOS + text + EOS, every token after BOS predicted
        for t in texts:
            ids = torch.tensor([tok(t)["input_ids"] + [tok.eos_token_id]])
            logits = subword.hf(ids[:, :-1], use_cache=False).logits
            nll += torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
            tokens += ids.shape[1] - 1
    want = nll / sum(len(t.encode()) for t in texts) / math.log(2)
    assert res["scored"] == "all" and res["documents"] == 60
    assert res["valid_bytes"] == sum(len(t.encode()) for t in texts)  # every byte of the file, once
    assert res["valid_tokens"] == tokens + len(texts) - 1  # and each later document's BOS
    assert abs(res["bits_per_byte"] - want) / want < 0.01
    assert sha(sixty, subword.model) == before
    code, out, _ = run(capsys, "eval", subword.model, "--data", sixty, "--windows", "3", "--prompts", "1",
                       "--new-tokens", "3")
    assert code == 0 and out.startswith(f"scored {3 * 256:,} tokens (") and "documents: the whole --data" in out


def test_the_byte_model_scores_a_whole_text_file(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("".join(f"line {i}: {'abc' * (i % 7)}\n" for i in range(300)))
    before = sha(f)
    code, out, err = run(capsys, "eval", "--data", f, "--seq", "64", "--prompts", "1", "--new-tokens", "3", "--json")
    assert code == 0, err
    res = json.loads(out)  # the byte codec ends a document with a blank line, which counts as two bytes
    assert res["documents"] == 1 and res["valid_bytes"] == len(f.read_bytes()) + 2 - 1 and sha(f) == before
    assert "cut inside" not in err  # the whole file is scored: no held-out set is used


def _crafted(tmp_path) -> Path:
    """60 documents of which the split's hash holds out three, the largest of them last: cut into thirds by
    position at document starts, the report set was empty (`0 tokens`)."""
    f = tmp_path / "crafted.jsonl"
    held = [i for i in range(60) if pk_data.is_validation(f"crafted.jsonl:{i + 1}")]
    body = [f.read_text(errors="replace") for f in stdlib_files()[300:] if f.stat().st_size > 8000][:60]
    texts = [body[i][:1500] for i in range(60)]
    for i in held[:-1]:
        texts[i] = body[i][:300]
    texts[held[-1]] = body[held[-1]][:7000]
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return f


def test_every_held_out_set_has_windows_on_a_corpus_cut_by_position_before(subword, tmp_path, capsys):
    data = _crafted(tmp_path)
    code, out, err = run(capsys, "eval", subword.model, "--data", data, "--held-out", "report", "--windows", "2",
                         "--prompts", "1", "--new-tokens", "3", "--json")
    assert code == 0, err
    from puzzlekit import ir

    corpus = pk_data.corpus_for(ir.load(subword.model), [data])
    assert not corpus.inside and all(len(corpus.held_out(r)) >= 257 for r in HELD_OUT)
    assert json.loads(out)["scored"] == "report"


def test_compress_refuses_short_sets_before_any_work(subword, tmp_path, capsys):
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    line = refused(capsys, "compress", subword.model, "--quick", "--target", "h100", "--speedup", "1.3", "--data",
                   data, "-o", out)
    assert "set (" in line and "tokens" in line and "shorter than one window" in line and "--data" in line
    assert not (out / "library").exists() and not (out / "work").exists()


# -- 3: inputs are files we read, never write ------------------------------------------------------------------
@pytest.fixture
def watchdog():
    """A test that would hang (a FIFO opened for reading) fails after 60 s instead."""
    def fail(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_fifo_as_data_is_refused_without_opening_it(tmp_path, capsys, watchdog):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    line = refused(capsys, "eval", "--data", fifo)
    assert "FIFO" in line and str(fifo) in line
    with pytest.raises(pk_data.DataError, match="is a FIFO"):
        pk_data.load_corpus([str(fifo)])


def test_a_json_file_is_read_as_records(subword, tmp_path):
    from puzzlekit.text.tokenizer import load_tokenizer

    tok = load_tokenizer(subword.model)
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    rendered = subword.tokenizer.apply_chat_template(chat, tokenize=False)
    array, one, lines = tmp_path / "array.json", tmp_path / "one.json", tmp_path / "lines.json"
    array.write_text(json.dumps([{"messages": chat}, {"text": "plain"}]))
    one.write_text(json.dumps({"prompt": "a", "completion": "b"}))
    lines.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "y"}) + "\n")
    read = lambda f: [t for _, t in pk_data.read_documents(f, tok.render_chat)]
    assert read(array) == [rendered, "plain"] and read(one) == ["ab"] and read(lines) == ["x", "y"]
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(pk_data.DataError, match=r"bad.json row 1: each record must be an object"):
        read(bad)


@pytest.mark.parametrize("kind", ["safetensors", "zip"])
def test_binary_files_are_refused_as_data(subword, tmp_path, capsys, kind):
    import zipfile

    if kind == "safetensors":
        f, words = subword.model / "model.safetensors", "model weights (safetensors)"
    else:
        f, words = tmp_path / "corpus.txt", "zip archive"
        with zipfile.ZipFile(f, "w") as z:
            z.writestr("a.txt", "hello " * 100)
    before = sha(f)
    line = refused(capsys, "eval", subword.model, "--data", f)
    assert words in line and "not text" in line and sha(f) == before


def test_the_cache_key_follows_the_chat_template(subword, tmp_path, capsys):
    model = _model_copy(subword, tmp_path / "model")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}?"},
                                                     {"role": "assistant", "content": f"answer {i * 7}"}]}) + "\n"
                            for i in range(200)))
    args = ["eval", model, "--data", data, "--prompts", "1", "--new-tokens", "3", "--seq", "64", "--json"]
    first = json.loads(run(capsys, *args)[1])
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(template.replace("<|{{ m['role'] }}|>", "### {{ m['role'] }}:"))
    second = json.loads(run(capsys, *args)[1])
    assert second["valid_bytes"] != first["valid_bytes"] and second["bits_per_byte"] != first["bits_per_byte"]


@pytest.mark.parametrize("case", ["build-engine-data", "run-tokenizer", "train-data", "compress-include-path",
                                  "compress-library", "compress-cost-table", "plan-report"])
def test_no_output_may_touch_an_input(subword, tmp_path, capsys, case):
    out = tmp_path / "out"
    out.mkdir()
    (out / "corpus.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x\n" * 200}) + "\n")
    shutil.copytree(subword.tokenizer_dir, out / "tok")
    (out / "table.json").write_text("{}")
    argv = {"build-engine-data": ["build-engine", "--target", "h100", "--build", "no", "-o", out, "--overwrite",
                                  "--data", out / "corpus.jsonl"],
            "run-tokenizer": ["run", "-p", "verify", "-o", out / "tok", "--overwrite", "--tokenizer", out / "tok"],
            "train-data": ["train", "-o", out, "--data", out / "corpus.jsonl", "--steps", "1"],
            "compress-include-path": ["compress", "--quick", "--speedup", "1.3", "-o", out, "--include-path", out / "tok"],
            "compress-library": ["compress", "--quick", "--speedup", "1.3", "-o", out / "tok" / "run", "--library",
                                 out / "tok"],
            "compress-cost-table": ["compress", "--quick", "--speedup", "1.3", "-o", out / "table.json",
                                    "--cost-table", out / "table.json"],
            "plan-report": ["plan", out / "tok", "--target", "h100", "--speedup", "1.3", "--sweep", "1.1,1.2",
                            "--report", out / "tok" / "sweep.png"]}[case]
    before = sha(out)
    line = refused(capsys, *argv)
    assert ("would replace the input" in line or "lies inside the input" in line) and "choose" in line
    assert sha(out) == before


# -- 4, 6: errors named, before any work -----------------------------------------------------------------------------
def test_a_chat_template_that_raises_names_the_record_and_the_prompt(subword, tmp_path, capsys):
    template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>\n"
                "{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    model = _model_copy(subword, tmp_path / "model", template)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"messages": [{"role": "tool", "content": "y"}]}) + "\n")
    line = refused(capsys, "eval", model, "--data", data)
    assert f"{data}:2" in line and "unknown role tool" in line
    base = _model_copy(subword, tmp_path / "base", "{{ raise_exception('a base model has no chat format') }}")
    line = refused(capsys, "generate", base, "--prompt", "hello there", "--chat")
    assert "'hello there'" in line and "a base model has no chat format" in line and "drop --chat" in line


def test_a_cache_that_is_a_file_is_refused(subword, tmp_path, capsys, monkeypatch):
    f = tmp_path / "cachefile"
    f.write_text("not a directory")
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(f))
    line = refused(capsys, "eval", subword.model, "--data", subword.docs)
    assert "PUZZLEKIT_CACHE" in line and "not a directory" in line and f.read_text() == "not a directory"


def test_train_on_special_tokens_alone_is_refused_before_training(subword, tmp_path, capsys):
    data = tmp_path / "special.jsonl"
    data.write_text("".join(json.dumps({"text": "<s></s>" * 50}) + "\n" for _ in range(30)))
    line = refused(capsys, "train", "-o", tmp_path / "run", "--tokenizer", subword.tokenizer_dir, "--data", data,
                   "--steps", "2", "--batch", "2", "--seq", "32")
    assert "special tokens alone" in line
    assert not (tmp_path / "run" / "train_state.pt").exists() and not (tmp_path / "run" / "model").exists()


# -- 5: plans and sweeps bounded before they run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def meta_lib(tmp_path_factory):
    from puzzlekit import ir
    from puzzlekit.passes.puzzle import build_library
    from puzzlekit.tools.default_model import DEFAULT_MODEL

    return build_library(ir.load(DEFAULT_MODEL / "config.json"), tmp_path_factory.mktemp("lib") / "lib")


@pytest.mark.parametrize("sweep,words", [("1:2:1e-8", "100,000,001 points"), ("1:2:1e-9", "points"),
                                         ("1:inf:0.5", "finite"), ("nan,1.2", "finite"), ("1:2", "LO:HI:STEP")])
def test_sweeps_are_counted_and_bounded_before_any_point(tmp_path, capsys, sweep, words):
    line = refused(capsys, "plan", tmp_path / "no-library", "--target", "h100", "--sweep", sweep)
    assert "--sweep" in line and words in line  # before the library is even read


def test_report_is_checked_first_and_the_printed_path_is_written(meta_lib, tmp_path, capsys):
    base = ["plan", meta_lib.path, "--target", "h100", "--scenario", "chat"]
    assert "give --sweep too" in refused(capsys, *base, "--speedup", "1.2", "--report", tmp_path / "a.png")
    assert "does not exist" in refused(capsys, *base, "--sweep", "1.1,1.2", "--report", tmp_path / "no" / "a.png")
    assert "is a directory" in refused(capsys, *base, "--sweep", "1.1,1.2", "--report", tmp_path)
    assert ".png" in refused(capsys, *base, "--sweep", "1.1,1.2", "--report", tmp_path / "plot")
    code, out, _ = run(capsys, *base, "--sweep", "1.1,1.2", "--report", tmp_path / "s.svg")
    assert code == 0 and out.strip().endswith(f"wrote {tmp_path / 's.svg'}")
    assert (tmp_path / "s.svg").read_text().lstrip().startswith("<?xml")


# -- 6: lm-eval tasks --------------------------------------------------------------------------------------------------
@pytest.fixture
def tasks(local_tasks, tmp_path) -> Path:
    d = tmp_path / "tasks"
    shutil.copytree(local_tasks, d)
    return d


def test_a_broken_task_yaml_and_a_missing_folder_are_named(subword, tasks, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    (tasks / "pk_broken.yaml").write_text("task: pk_broken\ndataset_path: json\n  bad: [unclosed\n")
    line = refused(capsys, "eval", subword.model, "--tasks", "pk_broken", "--include-path", tasks)
    assert "pk_broken.yaml" in line and "could not read" in line and "mapping" in line
    line = refused(capsys, "eval", subword.model, "--tasks", "pk_mc", "--include-path", tmp_path / "nowhere")
    assert "no such folder" in line and "nowhere" in line


def test_few_shot_counts_are_checked_before_any_model_runs(subword, tasks, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    before = sha(tasks)
    line = refused(capsys, "eval", subword.model, "--tasks", "pk_mc", "--include-path", tasks, "--num-fewshot", "50")
    assert "--num-fewshot 50" in line and "pk_mc has 11 documents" in line
    line = refused(capsys, "compress", subword.model, "--quick", "--speedup", "1.3", "-o", tmp_path / "run",
                   "--tasks", "pk_mc", "--include-path", tasks, "--num-fewshot", "50")
    assert "pk_mc has 11 documents" in line and not (tmp_path / "run").exists()
    assert "--num-fewshot" in refused(capsys, "compress", subword.model, "--quick", "--speedup", "1.3", "-o",
                                      tmp_path / "run", "--tasks", "pk_mc", "--include-path", tasks,
                                      "--num-fewshot", "-1")
    assert sha(tasks) == before


@pytest.mark.slow  # an edge of lm-eval's hf model (13 s)
def test_an_answer_longer_than_the_context_is_refused_as_the_hf_model_does(subword, tasks, capsys):
    pytest.importorskip("lm_eval")
    long = " ".join(str(i) for i in range(6000))
    (tasks / "long.jsonl").write_text(json.dumps({"question": "count:", "choices": [" 1 2 3", long], "answer": 0}) + "\n")
    (tasks / "pk_long.yaml").write_text(
        f"task: pk_long\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'long.jsonl'}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    line = refused(capsys, "eval", subword.model, "--tasks", "pk_long", "--include-path", tasks)
    assert "longer than the model's context of 4,096 tokens" in line


@pytest.mark.slow  # an edge of lm-eval's hf model (19 s)
def test_a_tokenizer_without_bos_or_eos(subword, tasks, tmp_path, capsys):
    """lm-eval's `hf` model fails on None for both; rolling log-likelihood needs a token to start from (refused),
    generation stops at the task's stop strings."""
    pytest.importorskip("lm_eval")
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    model = _model_copy(subword, tmp_path / "model")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / f).unlink(missing_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(subword.tokenizer_dir / "tokenizer.json"), pad_token="<pad>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    tok.save_pretrained(model)
    line = refused(capsys, "eval", model, "--tasks", "pk_ppl", "--include-path", tasks, "--limit", "1")
    assert "neither a BOS nor an EOS" in line
    code, out, err = run(capsys, "eval", model, "--tasks", "pk_gen", "--include-path", tasks, "--limit", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["rows"][0]["metric"] == "exact_match"


# -- compress on the plain corpus ------------------------------------------------------------------------------
@pytest.mark.slow
def test_compress_quick_on_the_sixty_documents(subword, sixty, tmp_path, capsys):
    before = sha(sixty, subword.model)
    code, _, err = run(capsys, "compress", subword.model, "--quick", "--target", "h100", "--scenario", "decode-heavy",
                       "--speedup", "1.3", "--data", sixty, "-o", tmp_path / "run", "--json")
    assert code == 0, err
    assert (tmp_path / "run" / "model" / "config.json").is_file() and sha(sixty, subword.model) == before
