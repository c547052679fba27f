"""Real text: a subword model reads its own tokenizer's ids in every command, its figures agree with transformers'
on the same text, the field's data formats read, and a subword model without a tokenizer is refused before any
work. The oracles are transformers' own tokenizer and NemotronH (see conftest's `subword`)."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from puzzlekit.text import data as pk_data  # noqa: E402
from puzzlekit import ir  # noqa: E402
from puzzlekit.text.data import HELD_OUT, corpus_for, held_out_windows, load_corpus  # noqa: E402
from puzzlekit.text.tokenizer import BYTES, load_tokenizer, tokenizer_of  # noqa: E402
from puzzlekit.tools.cli import main  # noqa: E402


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test tokenizes into its own cache and starts with no corpus in memory."""
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pk_data, "_CORPORA", {})


def _cli(capsys, *argv) -> tuple[int, dict | str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    try:
        return code, json.loads(out), err
    except json.JSONDecodeError:
        return code, out, err


def _oracle_document(tok, text: str) -> list[int]:
    return tok(text)["input_ids"] + [tok.eos_token_id]  # its post-processor adds BOS


# -- tokenization -----------------------------------------------------------------------------------------------
def test_documents_are_tokenized_as_transformers_does_and_held_out_by_document(subword):
    prog = ir.load(subword.model)
    assert prog.meta["tokenizer"] == str(subword.model.resolve())
    corpus = corpus_for(prog, [subword.docs])
    texts = [json.loads(line)["text"] for line in subword.docs.read_text().splitlines()]
    oracle = [_oracle_document(subword.tokenizer, t) for t in texts]
    names = [f"docs.jsonl:{i + 1}" for i in range(len(texts))]
    stored = corpus.order.tolist()  # training documents, then each set's, in file order within each
    cut = int(corpus.bounds[0])
    assert corpus.tokens.tolist() == [i for d in stored for i in oracle[d]]
    train = [d for d in stored if sum(len(oracle[e]) for e in stored[:stored.index(d)]) < cut]
    held = set(stored) - set(train)
    assert {d for d, n in enumerate(names) if pk_data.is_validation(n)} <= held and len(held) >= 3
    assert train == sorted(train)
    # each held-out set is whole documents: it starts at a BOS and ends at an EOS, and together they are the stream
    parts = [corpus.held_out(role) for role in HELD_OUT]
    assert np.array_equal(np.concatenate(parts), corpus.valid)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= max(len(oracle[d]) for d in held)  # balanced to a document
    for p in parts:
        assert p[0] == subword.tokenizer.bos_token_id and p[-1] == subword.tokenizer.eos_token_id


def test_a_second_load_reads_the_cache_instead_of_tokenizing(subword, monkeypatch):
    prog = ir.load(subword.model)
    first = corpus_for(prog, [subword.docs])
    monkeypatch.setattr(pk_data, "_CORPORA", {})
    tok = tokenizer_of(prog)
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a: pytest.fail("tokenized again"))
    again = corpus_for(prog, [subword.docs])
    assert np.array_equal(first.train, again.train) and np.array_equal(first.valid, again.valid)


def test_chat_prompt_completion_parquet_and_saved_datasets(subword, tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = tokenizer_of(ir.load(subword.model))
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    records = [{"messages": chat}, {"conversations": [{"from": "human", "value": "What is 2+2?"},
                                                     {"from": "gpt", "value": "4"}]},
               {"prompt": "def f(x):", "completion": "\n    return x"}, {"text": "plain text"}]
    want = [subword.tokenizer.apply_chat_template(chat, tokenize=False)] * 2 + ["def f(x):\n    return x", "plain text"]
    jl = tmp_path / "mixed.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = [t for _, t in pk_data.read_documents(jl, tok.render_chat)]
    assert got == want
    ids = tok.document(tok.encode_batch([got[0]])[0], got[0])
    assert ids == [subword.tokenizer.bos_token_id] + list(subword.tokenizer.apply_chat_template(chat, tokenize=True)
                                                         ["input_ids"]) + [subword.tokenizer.eos_token_id]
    datasets.Dataset.from_list([{"text": t} for t in want]).to_parquet(str(tmp_path / "d.parquet"))
    assert [t for _, t in pk_data.read_documents(tmp_path / "d.parquet", tok.render_chat)] == want
    datasets.Dataset.from_list([records[2]] * 2).save_to_disk(str(tmp_path / "saved"))  # one schema per dataset
    assert [t for _, t in pk_data.read_documents(tmp_path / "saved", tok.render_chat)] == [want[2]] * 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"title": "x"}) + "\n")
    with pytest.raises(pk_data.DataError, match=r"bad.jsonl:1: .*\"text\", chat \"messages\".*title"):
        list(pk_data.read_documents(bad, tok.render_chat))


def test_token_bytes_are_the_bytes_each_token_decodes_to(subword):
    tok = load_tokenizer(subword.tokenizer_dir)
    text = "déjà vu: naïve 漢字 code\n\tx = 1  # ünïcödé"
    ids = tok.encode(text)
    assert int(tok.token_bytes[ids].sum()) == len(text.encode())
    assert tok.token_bytes[subword.tokenizer.eos_token_id] == 0 and tok.token_bytes[subword.tokenizer.bos_token_id] == 0


# -- figures against transformers ---------------------------------------------------------------------------------
def _transformers_figures(subword, windows) -> tuple[float, float]:
    """The oracle on windows [n, T + 1]: transformers' summed NLL (nats) of the last T tokens, and its bits per
    byte over the bytes transformers' tokenizer decodes those tokens to."""
    with torch.no_grad():
        logits = subword.hf(windows[:, :-1], use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1),
                                            reduction="sum").item()
    nbytes = sum(len(subword.tokenizer.decode(w[1:], skip_special_tokens=True).encode()) for w in windows.tolist())
    return nll, nll / nbytes / math.log(2)


def test_eval_bits_per_byte_matches_transformers(subword, capsys):
    code, res, _ = _cli(capsys, "eval", subword.model, "--data", subword.docs, "--held-out", "report", "--windows", "6",
                        "--seq", "64", "--prompts", "2", "--new-tokens", "4", "--json")
    assert code == 0, res
    windows = held_out_windows(corpus_for(ir.load(subword.model), [subword.docs]), "report", 65, limit=6)
    nll, want = _transformers_figures(subword, windows)
    assert abs(res["bits_per_byte"] - want) / want < 0.01
    assert res["valid_tokens"] == windows[:, 1:].numel() and res["tokenizer"] == str(subword.model.resolve())
    assert abs(res["nll_per_token"] - nll / windows[:, 1:].numel()) < 1e-4 * abs(res["nll_per_token"])
    assert res["bits_per_byte"] < res["unigram_bits_per_byte"] * 4  # per token of the same tokenizer, not bytes


def test_the_byte_model_figures_do_not_change(capsys):
    code, res, _ = _cli(capsys, "eval", "--windows", "8", "--seq", "128", "--prompts", "2", "--new-tokens", "8",
                        "--json")
    assert code == 0
    # the report set's first windows since the sets are whole documents dealt by size (before: 1.8111546276984145
    # and 4.841242203260673 on the old, position-cut report set, as the byte-level code measured before tokenizers)
    assert res["tokenizer"] == "bytes" and res["valid_bytes"] == 1024 == res["valid_tokens"]
    assert res["scored"] == "report"
    assert abs(res["bits_per_byte"] - 1.9043496184438584) < 1e-6
    assert abs(res["unigram_bits_per_byte"] - 5.028434238239282) < 1e-6


@pytest.mark.parametrize("backend", ["torch", pytest.param("onnx", marks=pytest.mark.slow)])  # onnx: 16 s
def test_generate_equals_transformers_greedy(subword, capsys, backend, tmp_path, monkeypatch):
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path))
    prompt = "def main(argv):\n    "
    code, res, _ = _cli(capsys, "generate", subword.model, "--prompt", prompt, "--max-new-tokens", "12",
                        "--backend", backend, "--json")
    assert code == 0, res
    ids = subword.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = subword.hf.generate(ids, max_new_tokens=12, do_sample=False)
    assert res["new_tokens"] == out[0, ids.shape[1]:].tolist()
    assert res["completion"] == subword.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_chat_goes_through_the_template(subword, capsys):
    code, res, _ = _cli(capsys, "generate", subword.model, "--prompt", "hi", "--chat", "--max-new-tokens", "2",
                        "--json")
    assert code == 0
    text = subword.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert res["tokens"][:-len(res["new_tokens"])] == subword.tokenizer(text)["input_ids"]


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bare(subword, tmp_path_factory):
    """The subword checkpoint without its tokenizer files."""
    d = tmp_path_factory.mktemp("bare") / "model"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(subword.model / f, d / f)
    return d


@pytest.mark.parametrize("argv", [
    ["eval", "{m}", "--data", "{docs}"],
    ["generate", "{m}", "--prompt", "x"],
    ["library", "{m}", "-o", "{out}"],
    ["run", "{m}", "-p", "distill{steps=1}", "-o", "{out}"],
    ["run", "{m}", "-p", "quantize{recipe=fp8}", "-o", "{out}"],
    ["build-engine", "{m}", "--target", "h100", "-o", "{out}"],
    ["compress", "{m}", "--quick", "-o", "{out}"],
], ids=lambda a: a[0] + (f"-{a[3]}" if a[0] == "run" else ""))
def test_a_subword_model_without_a_tokenizer_is_refused_before_any_work(bare, subword, tmp_path, capsys, argv):
    out = tmp_path / "out"
    fill = {"{m}": str(bare), "{docs}": str(subword.docs), "{out}": str(out)}
    code = main([fill.get(a, a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--tokenizer" in err and "1,024-token vocabulary" in err
    assert "Traceback" not in err and not out.exists()


def test_tokenizer_flag_gives_a_bare_checkpoint_its_tokenizer(bare, subword, capsys):
    code, res, _ = _cli(capsys, "generate", bare, "--tokenizer", subword.tokenizer_dir, "--prompt", "def f",
                        "--max-new-tokens", "3", "--json")
    assert code == 0 and res["tokenizer"] == str(subword.tokenizer_dir)


def test_a_tokenizer_too_big_for_the_model_and_a_teacher_with_another_are_refused(subword, tmp_path, capsys):
    code = main(["eval", "--tokenizer", str(subword.tokenizer_dir), "--windows", "1"])  # built-in: vocabulary 256
    err = capsys.readouterr().err
    assert code == 2 and "1,024 ids but the model's vocabulary is 256" in err
    code = main(["eval", str(subword.model), "--teacher", "default", "--data", str(subword.docs)])
    err = capsys.readouterr().err
    assert code == 2 and "differ" in err and "tokenizer" in err


def test_hub_ids_offline_and_not_cached_are_refused_naming_the_local_way(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code = main(["inspect", "nvidia/not-a-cached-model"])
    err = capsys.readouterr().err
    assert code == 2 and "not in the local hub cache" in err and "--local-dir" in err
    with pytest.raises(pk_data.DataError, match="not cached and the hub cannot be reached"):
        load_corpus(["someone/not-a-cached-dataset"])


# -- outputs carry the tokenizer -------------------------------------------------------------------------------------
def test_outputs_carry_the_parents_tokenizer(subword, tmp_path, capsys):
    out = tmp_path / "child"
    assert main(["run", str(subword.model), "-p", "set-topk{k=1,layers=[1]}", "-o", str(out)]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (subword.model / f).read_bytes(), f
    assert tokenizer_of(ir.load(out)).vocab_hash == load_tokenizer(subword.model).vocab_hash
    # the engine bundle's copy: tests/test_family.py (compress of the dense miniature, in this tokenizer)


def test_the_byte_model_keeps_its_byte_codec():
    prog = ir.load(__import__("puzzlekit.tools.default_model", fromlist=["x"]).DEFAULT_MODEL)
    assert tokenizer_of(prog) is BYTES and "tokenizer" not in prog.meta


@pytest.mark.slow
def test_compress_quick_on_a_subword_model_with_jsonl_data(subword, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["compress", str(subword.model), "--quick", "--target", "h100", "--scenario", "decode-heavy",
                 "--speedup", "1.3", "--data", str(subword.docs), "-o", str(out), "--json"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    child = out / "model"
    assert (child / "tokenizer.json").read_bytes() == (subword.model / "tokenizer.json").read_bytes()
    code, res, _ = _cli(capsys, "eval", child, "--data", subword.docs, "--windows", "4", "--seq", "64", "--prompts",
                        "2", "--new-tokens", "4", "--json")
    assert code == 0 and math.isfinite(res["bits_per_byte"])
    quality = json.loads((out / "work" / "quality.done").read_text())
    assert quality["child"]["bits_per_byte"] > 0 and quality["parent"]["nll_per_token"] > 0


def test_a_model_without_an_mtp_head_passes_the_mtp_stages(subword, tmp_path, capsys):
    """Nemotron-3-Nano has no MTP head: compress's mtp-check and head-only recovery have nothing to do."""
    d = tmp_path / "nano-like"
    subword.hf.save_pretrained(d)
    subword.tokenizer.save_pretrained(d)
    pipeline = "snapshot{name=teacher},mtp-check{prompts=1,new_tokens=2},distill{head_only=true,steps=1}"
    code = main(["run", str(d), "-p", pipeline, "--data", str(subword.docs), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "nothing to check" in err and "nothing to train" in err


def test_pipeline_passes_read_the_models_tokens(subword, small_grid_file, tmp_path):
    """distill, mtp-check, quantize and the library on a subword model: the teacher's bits per byte that distill
    reports is transformers' on the same selection windows."""
    from puzzlekit.passes import PassManager
    from puzzlekit.passes.puzzle import LibrarySettings, build_library

    prog = ir.load(subword.model)
    pipeline = ("snapshot{name=teacher},set-topk{k=1,layers=[1]},distill{steps=2,batch=2,seq=32,eval_windows=2,"
                "eval_every=1},mtp-check{prompts=1,new_tokens=2,tolerance=1.0},quantize{recipe=fp8,samples=2,seq=32}")
    am = PassManager(pipeline, data=[str(subword.docs)]).run(prog)
    windows = held_out_windows(corpus_for(prog, [subword.docs]), "selection", 33, limit=2)
    got = am.reports["distill"][0]["teacher_bits_per_byte"]
    assert abs(got - _transformers_figures(subword, windows)[1]) < 1e-4 * got
    assert am.reports["mtp-check"][0]["acceptance"] >= 1
    lib = build_library(ir.load(subword.model), tmp_path / "lib", small_grid_file,
                        LibrarySettings(calib_windows=2, score_windows=1, seq=32, bld_tokens=128, data=[str(subword.docs)]))
    assert all(math.isfinite(r["scores"]["kl"]) for r in lib.rows)


def test_train_in_a_tokenizers_vocabulary(subword, tmp_path, capsys):
    code, res, _ = _cli(capsys, "train", "-o", tmp_path / "run", "--tokenizer", subword.tokenizer_dir, "--data",
                        subword.docs, "--steps", "2", "--batch", "2", "--seq", "32", "--json")
    assert code == 0
    child = ir.load(tmp_path / "run" / "model")
    assert child.find("embed")[0].op.vocab == 1024 == tokenizer_of(child).vocab_size
    assert (tmp_path / "run" / "model" / "tokenizer.json").read_bytes() == \
        (subword.tokenizer_dir / "tokenizer.json").read_bytes()
    assert res["valid_tokens"] < res["valid_bytes"]  # subwords: more bytes than tokens
