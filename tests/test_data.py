"""The three held-out sets: disjoint by document, dealt by size (not position) so they are balanced by tokens,
each with windows to draw; and each use draws its windows from its own."""
import numpy as np
import pytest
import torch

from puzzlekit.text import data as pk_data
from puzzlekit.text.data import (HELD_OUT, MIN_SET_TOKENS, SEPARATOR, DataError, covering_windows, held_out_windows,
                            is_validation, load_corpus, require_windows, split_documents)


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus(None)


def _user(tmp_path, docs: int):
    """A user corpus of `docs` files (one file: the few-documents fallback), 75 KB or more in all."""
    d = tmp_path / f"docs{docs}"
    d.mkdir()
    for i in range(docs):
        (d / f"f{i}.txt").write_text("".join(f"doc {i} line {j}: {'xyz' * (j % 9)}\n\n" for j in range(max(60, 3000 // docs))))
    return load_corpus([str(d)])


def _offsets(corpus) -> list[tuple[int, int]]:
    """The token range of each set inside the held-out stream."""
    base = corpus.valid.__array_interface__["data"][0]
    out = []
    for role in HELD_OUT:
        part = corpus.held_out(role)
        assert len(part) and np.shares_memory(part, corpus.valid), role
        start = part.__array_interface__["data"][0] - base
        out.append((start, start + len(part)))
    return out


def _check_partition(corpus, length: int, limit: int):
    ranges = _offsets(corpus)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(corpus.valid)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # consecutive: disjoint, and together all of it
    assert all(hi - lo >= len(corpus.valid) // 4 for lo, hi in ranges)  # about a third each
    parts = [corpus.held_out(r) for r in HELD_OUT]
    assert b"".join(p.tobytes() for p in parts) == corpus.valid.tobytes()
    windows = {}
    for role, part in zip(HELD_OUT, parts):
        w = held_out_windows(corpus, role, length, limit)
        n = len(w)
        assert n == limit and torch.equal(w, torch.from_numpy(part[:n * length].astype(np.int64)).view(n, length))
        windows[role] = {tuple(row.tolist()) for row in w}
    assert not windows["scoring"] & windows["report"] and not windows["scoring"] & windows["selection"]
    assert not windows["selection"] & windows["report"]
    return parts


def test_default_corpus_sets_are_disjoint_whole_documents(stdlib):
    parts = _check_partition(stdlib, 257, 16)
    assert all(p[-2:].tobytes() == SEPARATOR for p in parts)  # each ends where a document ends
    assert len(stdlib.in_file_order()[0]) == len(stdlib.tokens) == int(stdlib.lengths.sum())


def test_user_corpus_sets_are_disjoint(tmp_path):
    corpus = _user(tmp_path, 200)
    assert len(corpus.train) > 5 * len(corpus.valid)  # split by file, not the fallback
    assert not corpus.inside
    _check_partition(corpus, 65, 4)


# -- the rule itself, on document sizes -------------------------------------------------------------------------------
def _sets_by_name(names, lengths):
    sets = split_documents(names, np.array(lengths))
    return [sorted(names[i] for i in s) for s in sets]


def test_sets_are_dealt_by_size_not_position():
    """The issue's corpus: three held-out documents, the largest last. Cut by position at a third and two
    thirds of the tokens, the report set was empty; dealt by size, each set holds one document, whatever the
    order of the files."""
    names = [f"d{i}" for i in range(4000)]
    held = [n for n in names if is_validation(n)][:3]
    lengths = {n: 400 for n in names} | {held[0]: 100, held[1]: 100, held[2]: 2300}
    rest = [n for n in names if n not in held][:57]
    docs = rest + held
    sets = _sets_by_name(docs, [lengths[n] for n in docs])
    assert set(held) <= set(sum(sets, []))
    assert min(sum(lengths[n] for n in s) for s in sets) >= MIN_SET_TOKENS  # more held out: every set has windows
    shuffled = docs[::-1]
    assert _sets_by_name(shuffled, [lengths[n] for n in shuffled]) == sets  # not by position


def test_short_sets_get_more_documents_and_training_keeps_half():
    names = [f"doc{i}" for i in range(300)]
    lengths = np.full(300, 50)
    sets = split_documents(names, lengths)
    sizes = [int(lengths[s].sum()) for s in sets]
    held = {i for s in sets for i in s}
    assert {i for i, n in enumerate(names) if is_validation(n)} <= held  # the named ones stay held out
    assert min(sizes) >= min(MIN_SET_TOKENS, max(300 * 50 // 20, min(3 * MIN_SET_TOKENS, 300 * 50 // 4)) // 3)
    assert max(sizes) - min(sizes) <= 50  # balanced to a document
    assert sum(sizes) <= 300 * 50 // 2


def test_too_few_documents_are_cut_inside_and_said_once(tmp_path, capsys):
    assert split_documents(["a", "b", "c"], np.array([5000, 5000, 5000])) is None
    corpus = _user(tmp_path, 1)
    assert corpus.inside and len(corpus.valid) == 3 * MIN_SET_TOKENS
    assert "cut inside" not in capsys.readouterr().err  # said when a held-out set is used
    corpus.held_out("report")
    assert capsys.readouterr().err.count("cut inside documents") == 1
    load_corpus([str(tmp_path / "docs1")]).held_out("scoring")
    assert "cut inside" not in capsys.readouterr().err  # once per process
    parts = _check_partition(corpus, 65, 4)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_each_use_draws_from_its_own_set(tmp_path):
    from puzzlekit.passes.distill import Distill, text_source
    from puzzlekit.passes.puzzle.build import LibrarySettings, library_windows
    from puzzlekit.text.tokenizer import BYTES
    from puzzlekit.tools.default_model import load_default

    data = [str(tmp_path / "docs200")]
    corpus = _user(tmp_path, 200)
    distill_eval = text_source(Distill(seq=64, eval_windows=3, data=data), BYTES).held_out
    assert torch.equal(distill_eval, held_out_windows(corpus, "selection", 65, 3))
    _, scored = library_windows(LibrarySettings(seq=64, score_windows=3, calib_windows=1, data=data), load_default())
    assert torch.equal(scored, held_out_windows(corpus, "scoring", 65, 3))


def test_unknown_set_and_a_set_too_short_are_refused(tmp_path):
    corpus = _user(tmp_path, 200)
    with pytest.raises(DataError, match=r"unknown held-out set 'valid'; known: scoring, selection, report"):
        corpus.held_out("valid")
    with pytest.raises(DataError, match="unknown held-out set"):
        held_out_windows(corpus, "test", 8)
    n = len(corpus.held_out("report"))
    with pytest.raises(DataError, match=rf"the report set \(eval\) has {n:,} tokens \(\d+ of its 200 documents\), "
                                        rf"shorter than one window of {n + 1:,} tokens; give more text"):
        require_windows(corpus, "report", n + 1, "eval")


def test_covering_windows_predict_every_token_once():
    stream = np.arange(1000, dtype=np.int32)
    parts = covering_windows(stream, 65)
    targets = np.concatenate([w[:, 1:].reshape(-1).numpy() for w in parts])
    assert targets.tolist() == list(range(1, 1000))
    assert [tuple(p.shape) for p in parts] == [(15, 65), (1, 40)]
    assert sum(len(p) for p in covering_windows(stream, 65, limit=4)) == 4
    with pytest.raises(DataError, match="nothing to score"):
        covering_windows(stream[:1], 65)


def test_the_cache_key_names_the_split_rule_and_the_document_format(monkeypatch):
    from puzzlekit.text.tokenizer import BYTES

    key = pk_data._cache_key([], BYTES, 10)
    monkeypatch.setattr(pk_data, "SPLIT_RULE", pk_data.SPLIT_RULE + "x")
    assert pk_data._cache_key([], BYTES, 10) != key
    monkeypatch.undo()
    monkeypatch.setattr(pk_data, "DOCUMENT_FORMAT", pk_data.DOCUMENT_FORMAT + 1)
    assert pk_data._cache_key([], BYTES, 10) != key
