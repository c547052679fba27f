"""Metrics on constructed cases with known answers, and the corpus split."""
import math

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from puzzlekit import evaluation as evaluate
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.errors import PuzzlekitError
from puzzlekit.text.data import (DataError, is_validation, random_windows, sequential_windows, stdlib_corpus, stdlib_files,
                            load_corpus)
from puzzlekit.tools.default_model import default_architecture


class Fixed(torch.nn.Module):
    """A 'model' whose next-byte distribution is the same everywhere."""

    def __init__(self, probs):
        super().__init__()
        self.logp = torch.log(torch.as_tensor(probs, dtype=torch.float32))

    def forward(self, ids):
        return self.logp.expand(*ids.shape, -1).clone()


def test_bits_per_byte_of_known_distributions():
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    assert evaluate.bits_per_byte(Fixed(torch.full((256,), 1 / 256)), ids) == pytest.approx(8.0, abs=1e-5)
    p = torch.full((256,), 0.5 / 255)
    p[7] = 0.5
    sevens = torch.full((2, 10), 7)
    assert evaluate.bits_per_byte(Fixed(p), sevens) == pytest.approx(1.0, abs=1e-5)


def test_unigram_baseline_matches_hand_count():
    train = np.array([0, 0, 0, 1], dtype=np.uint8)
    windows = torch.tensor([[5, 0, 1]])
    p0, p1 = 4 / 260, 2 / 260  # add-one smoothing over 256 symbols
    assert evaluate.unigram_bits_per_byte(train, windows) == pytest.approx(-(math.log2(p0) + math.log2(p1)) / 2)


@pytest.fixture(scope="module")
def model():
    return materialize(random_weights(default_architecture(), seed=3, std=0.2))


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))


def test_identical_models_agree_fully(model, windows):
    r = evaluate.teacher_agreement(model, model, windows)
    assert r["kl"] == pytest.approx(0.0, abs=1e-6) and r["top1_agreement"] == 1.0


def test_kl_matches_closed_form():
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    want = float((p * (p / q).log()).sum())
    r = evaluate.teacher_agreement(Fixed(p), Fixed(q), torch.zeros(2, 5, dtype=torch.long))
    assert r["kl"] == pytest.approx(want, rel=1e-5) and r["top1_agreement"] == 0.0


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_per_position_metrics_against_numpy_and_scipy():
    from scipy.special import rel_entr

    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 7, 50, generator=g) * 3, torch.randn(2, 7, 50, generator=g) * 3
    targets = torch.randint(0, 50, (2, 7), generator=g)
    for temperature in (1.0, 2.5):
        p, q = _softmax(t.double().numpy() / temperature), _softmax(s.double().numpy() / temperature)
        want = rel_entr(p, q).sum(-1)
        got = evaluate.kl(t, s, temperature)
        assert got.shape == (2, 7) and np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
        values, indices = torch.log_softmax(t, -1).topk(50, dim=-1)  # k = the vocabulary: the full KL
        assert np.allclose(evaluate.topk_kl(values, indices, s, temperature).numpy(), want, rtol=1e-5, atol=1e-6)
        v8, i8 = torch.log_softmax(t, -1).topk(8, dim=-1)
        p8 = _softmax(v8.double().numpy() / temperature)  # the teacher renormalised over its top 8
        want8 = rel_entr(p8, np.take_along_axis(q, i8.numpy(), -1)).sum(-1)
        assert np.allclose(evaluate.topk_kl(v8, i8, s, temperature).numpy(), want8, rtol=1e-5, atol=1e-6)
    want_nll = -np.log(np.take_along_axis(_softmax(s.double().numpy()), targets.numpy()[..., None], -1))[..., 0]
    assert np.allclose(evaluate.nll(s, targets).numpy(), want_nll, rtol=1e-5, atol=1e-6)
    assert torch.equal(evaluate.agrees(t.argmax(-1), s), torch.from_numpy(t.numpy().argmax(-1) == s.numpy().argmax(-1)))
    assert bool(evaluate.agrees(t.argmax(-1), t).all())


def test_decode_throughput_is_a_positive_rate_and_refuses_empty_work(model):
    rate = evaluate.decode_throughput(model, batch=2, context=8, repeats=3, warmup=1)
    assert math.isfinite(rate) and rate > 0
    for batch, context in ((0, 8), (2, 0)):
        with pytest.raises(PuzzlekitError, match=rf"batch, context and repeats >= 1.*batch {batch}, context {context}"):
            evaluate.decode_throughput(model, batch=batch, context=context)


def test_different_models_disagree(model, windows):
    other = materialize(random_weights(default_architecture(), seed=4, std=0.2))
    r = evaluate.teacher_agreement(model, other, windows)
    assert r["kl"] > 0.01 and r["top1_agreement"] < 1.0


def test_mtp_accuracy_counts_the_token_after_next(model, windows):
    with torch.no_grad():
        _, mtp = model(windows)
    want = (mtp[:, 1:-1].argmax(-1) == windows[:, 2:]).float().mean().item()
    assert evaluate.mtp_accuracy(model, windows) == pytest.approx(want)
    # a sequence made of the head's own predictions is predicted perfectly
    seq = windows[:1, :2].clone()
    for _ in range(10):
        with torch.no_grad():
            _, mtp = model(seq)
        seq = torch.cat([seq, mtp[:, -1:].argmax(-1)], dim=1)
    # prediction at t depends only on tokens <= t, so the appended tokens are exactly its argmaxes
    assert evaluate.mtp_accuracy(model, seq) == 1.0


def _greedy(model, seq, n):
    for _ in range(n):
        with torch.no_grad():
            nxt = model(seq[None])[0][0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_length_bounds(model, windows, k):
    prompts = windows[:2, :8]

    def oracle(seq, bonus, kk):  # always right: the trunk's own greedy continuation after the bonus token
        cont = _greedy(model, torch.cat([seq, torch.tensor([bonus])]), kk)
        return cont[-kk:].tolist()

    def wrong(seq, bonus, kk):
        return [(t + 1) % 256 for t in oracle(seq, bonus, kk)]

    assert evaluate.acceptance_length(model, prompts, k, 8, drafter=oracle) == pytest.approx(k + 1)
    assert evaluate.acceptance_length(model, prompts, k, 8, drafter=wrong) == pytest.approx(1.0)
    real = evaluate.acceptance_length(model, prompts, k, 8)
    assert 1.0 <= real <= k + 1


def _acceptance_from_scratch(model, prompts, k, new_tokens):
    """The oracle: every step drafts with `mtp_drafter` (the head over the whole sequence, fresh) and verifies
    with the trunk over the whole sequence, fresh; no state is carried."""
    drafter, lengths = evaluate.mtp_drafter(model), []
    for seq in prompts:
        with torch.no_grad():
            bonus, produced = int(model(seq[None])[0][0, -1].argmax()), 0
            while produced < new_tokens:
                drafts = drafter(seq, bonus, k)
                cand = torch.cat([seq, torch.tensor([bonus] + drafts)])
                greedy = model(cand[None])[0][0, len(seq):].argmax(-1).tolist()
                accepted = next((i for i in range(k) if drafts[i] != greedy[i]), k)
                lengths.append(accepted + 1)
                seq, bonus, produced = cand[: len(seq) + 1 + accepted], greedy[accepted], produced + accepted + 1
    return sum(lengths) / len(lengths)


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_from_the_decode_state_equals_running_every_step_from_scratch(k):
    """The built-in model's trained head drafts well on text, so drafts are kept whole, in part and not at all:
    every path of the cached verification runs, with the drafts verified in one chunk and after the trunk's next
    token alone (the form for a head whose first drafts mostly fail)."""
    from puzzlekit import ir
    from puzzlekit.tools.default_model import DEFAULT_MODEL

    model = materialize(ir.load(DEFAULT_MODEL))
    text = b"def main(argv):\n    for name in sorted(argv):\n        print(name)\n    return 0\n\n\nclass Point:\n"
    ids = torch.tensor(list(text))
    prompts = torch.stack([ids[i:i + 16] for i in (0, 20, 40)])
    oracle = _acceptance_from_scratch(model, prompts, k, 16)
    for decode_first in (None, False, True):
        got = evaluate.acceptance_length(model, prompts, k, 16, decode_first=decode_first)
        assert 1.3 < got and got == pytest.approx(oracle), decode_first


def test_mtp_drafter_first_draft_is_the_heads_prediction(model, windows):
    seq = windows[0, :9]
    bonus = int(model(seq[None])[0][0, -1].argmax())
    draft = evaluate.mtp_drafter(model)(seq, bonus, 2)
    with torch.no_grad():
        _, mtp = model(torch.cat([seq, torch.tensor([bonus])])[None])
    assert draft[0] == int(mtp[0, -1].argmax())


def test_stdlib_split_is_deterministic_and_disjoint():
    files = stdlib_files()
    assert len(files) > 500
    names = [f"doc{i}" for i in range(2000)]
    held = [n for n in names if is_validation(n)]
    assert held[:4] == ["doc7", "doc8", "doc12", "doc31"]  # a fixed hash of the name: the same on every machine
    assert 0.04 < len(held) / len(names) < 0.06  # about one in 20
    c = stdlib_corpus(limit_bytes=2_000_000)
    assert len(c.train) > 10 * len(c.valid) > 0
    assert c.train.dtype == np.uint8
    root = Path(sysconfig.get_paths()["stdlib"])
    first = next(f for f in files if is_validation(f.relative_to(root).as_posix()))
    text = first.read_bytes()[:200]  # a held-out file is in the held-out stream and not in the training one
    assert text in c.valid.tobytes() and text not in c.train.tobytes()


def test_user_corpus_files_dirs_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(30):
        (tmp_path / "d" / f"f{i}.txt").write_text(f"document {i} " * 20)
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00" * 100)
    jl = tmp_path / "x.jsonl"
    jl.write_text('{"text": "hello"}\n\n{"text": "world"}\n')
    c = load_corpus([tmp_path / "d", jl])
    total = len(c.train) + len(c.valid)
    assert b"\x00" not in c.train.tobytes() + c.valid.tobytes()
    assert total > 30 * 200
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: .*\"text\""):
        load_corpus([bad])
    with pytest.raises(DataError, match="does not exist"):
        load_corpus([tmp_path / "nope.txt"])


def test_windows():
    stream = np.arange(100, dtype=np.uint8)
    w = sequential_windows(stream, 10, limit=3)
    assert w.tolist()[1] == list(range(10, 20)) and w.shape == (3, 10)
    g = torch.Generator().manual_seed(0)
    r = random_windows(stream, 4, 10, g)
    assert r.shape == (4, 10) and bool(((r[:, 1:] - r[:, :-1]) == 1).all())
    with pytest.raises(DataError, match="shorter than one window"):
        random_windows(stream[:5], 1, 10, g)
