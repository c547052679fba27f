"""The three held-out sets: disjoint parts of the held-out text, and each use draws its windows from its own."""
import numpy as np
import pytest
import torch

from puzzlekit.data import HELD_OUT, SEPARATOR, DataError, held_out_windows, load_corpus


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
    """The byte range of each set inside the held-out stream."""
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


def test_default_corpus_sets_are_disjoint_document_cut_parts(stdlib):
    parts = _check_partition(stdlib, 257, 16)
    assert all(p[-2:].tobytes() == SEPARATOR for p in parts[:-1])  # cut between documents


def test_user_corpus_sets_are_disjoint(tmp_path):
    corpus = _user(tmp_path, 200)
    assert len(corpus.train) > 5 * len(corpus.valid)  # split by file, not the fallback
    _check_partition(corpus, 65, 4)


def test_few_documents_fallback_sets_are_disjoint(tmp_path):
    corpus = _user(tmp_path, 1)
    assert len(corpus.valid) == len(corpus.train.tobytes() + corpus.valid.tobytes()) // 20  # the tail
    _check_partition(corpus, 65, 4)


def test_each_use_draws_from_its_own_set(tmp_path):
    from puzzlekit.passes.distill import Distill, text_source
    from puzzlekit.passes.puzzle.build import LibrarySettings, library_windows
    from puzzlekit.tokenizer import BYTES
    from puzzlekit.tools.default_model import load_default

    data = [str(tmp_path / "docs200")]
    corpus = _user(tmp_path, 200)
    distill_eval = text_source(Distill(seq=64, eval_windows=3, data=data), BYTES).held_out
    assert torch.equal(distill_eval, held_out_windows(corpus, "selection", 65, 3))
    _, scored = library_windows(LibrarySettings(seq=64, score_windows=3, calib_windows=1, data=data), load_default())
    assert torch.equal(scored, held_out_windows(corpus, "scoring", 65, 3))


def test_unknown_set_and_a_set_too_short_are_refused(tmp_path):
    corpus = _user(tmp_path, 1)
    with pytest.raises(DataError, match=r"unknown held-out set 'valid'; known: scoring, selection, report"):
        corpus.held_out("valid")
    with pytest.raises(DataError, match="unknown held-out set"):
        held_out_windows(corpus, "test", 8)
    with pytest.raises(DataError, match=r"the report set \(a third of the held-out text\).*shorter than one window"):
        held_out_windows(corpus, "report", len(corpus.valid))
