"""Losses and scores over the vocabulary in token chunks (evaluation.vocab): equal to the whole-logits
computation in value and gradient, never keeping a tokens x vocabulary tensor, and a distillation with them
trains the same weights as one through the whole logits."""
from __future__ import annotations

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.evaluation import metrics, vocab
from puzzlekit.passes import PassManager
from puzzlekit.passes.distill import (LOSSES, Batch, Distill, _capture, _outputs, distill, register_loss,
                                      register_optimizer, soft_kl)
from puzzlekit.training import Schedule
from puzzlekit.tools.default_model import model_path


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 positions at the built-in model's 256-token vocabulary: every sum crosses several, and the
    last one is short."""
    monkeypatch.setattr(vocab, "CHUNK_BYTES", 4 * 256 * 7)


def _student(parent):
    prog = parent.copy()
    PassManager("set-topk{k=1},drop-blocks{layers=[2]}").run(prog)
    model = materialize(prog, dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.clone()
    model.requires_grad_(True)
    return model


def _batch(parent, student):
    ids = torch.randint(0, 256, (3, 30), generator=torch.Generator().manual_seed(0))
    teacher = materialize(parent)
    t_seen, t_undo = _capture(teacher)
    s_seen, s_undo = _capture(student)
    with torch.no_grad():
        t_out = _outputs(teacher, t_seen, ids[:, :-1])
    b = Batch(ids, _outputs(student, s_seen, ids[:, :-1]), t_out, temperature=1.7)
    t_undo(), s_undo()
    return b


#: each built-in term, computed through the whole logits as the definitions in evaluation.metrics say
WHOLE = {
    "kl": lambda b: soft_kl(b.teacher.logits, b.student.logits, b.temperature),
    "lm": lambda b: metrics.nll(b.student.logits, b.ids[:, 1:]).mean(),
    "mtp": lambda b: soft_kl(b.teacher.mtp[:, 1:], b.student.mtp[:, 1:], b.temperature),
    "mtp-self": lambda b: soft_kl(b.student.logits[:, 1:].detach(), b.student.mtp[:, 1:], b.temperature),
}


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_chunked_term_equals_the_whole_logits_in_value_and_gradient(parent, small_chunks, name):
    student = _student(parent)
    b = _batch(parent, student)
    chunked, whole = LOSSES[name](b), WHOLE[name](b)
    assert chunked.item() > 1e-4  # a pruned student: a term with something to learn
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    got, want = _grads(student, chunked), _grads(student, whole)
    assert got.keys() == want.keys() and len(got) > 10
    _close_grads(got, want)


def _close_grads(got, want):
    """Each gradient within 1e-5 of its own largest element, and of a millionth of the largest of all (a top-1
    router's gradient is zero up to rounding)."""
    overall = max(g.abs().max().item() for g in want.values())
    for n in want:
        atol = 1e-5 * want[n].abs().max().item() + 1e-6 * overall
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=atol, msg=n)


def test_the_stored_top_k_term_equals_its_whole_logits_form(parent, small_chunks):
    student = _student(parent)
    b = _batch(parent, student)
    v, ix = torch.log_softmax(b.teacher.logits, -1).topk(9, dim=-1)
    stored = Batch(b.ids, b.student, type(b.teacher)(None, None, []), b.temperature, (v, ix))
    chunked = LOSSES["kl"](stored)
    whole = metrics.topk_kl(v, ix, b.student.logits, b.temperature).mean() * b.temperature ** 2
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    _close_grads(_grads(student, chunked), _grads(student, whole))


def test_no_tokens_by_vocabulary_tensor_is_kept_for_the_backward(parent, small_chunks):
    """What autograd saves for the backward of the KL term: the whole computation keeps positions x vocabulary
    tensors; the chunked one only hidden rows and the LM head's matrix."""
    student = _student(parent)
    b = _batch(parent, student)
    positions = b.ids[:, 1:].numel()

    def largest_saved(term):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            term(b)
        return max(sizes, default=0)
    assert largest_saved(WHOLE["kl"]) >= positions * 256
    assert largest_saved(LOSSES["kl"]) < positions * 256 / 4


def test_the_evaluation_and_scores_equal_the_whole_logits(parent, small_chunks):
    student = _student(parent).eval()
    teacher = materialize(parent)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    t_last, _ = vocab.heads(teacher, ids)
    s_last, s_mtp = vocab.heads(student, ids)
    with torch.no_grad():
        t_logits, _ = teacher(ids)
        s_logits, s_mtp_logits = student(ids)
        got = vocab.scores(t_last.rows(), s_last.rows(), ids.reshape(-1))
        torch.testing.assert_close(got["kl"], metrics.kl(t_logits, s_logits).reshape(-1), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got["nll"], metrics.nll(s_logits, ids).reshape(-1), rtol=1e-6, atol=0)
        assert torch.equal(got["agree"], (t_logits.argmax(-1) == s_logits.argmax(-1)).reshape(-1))
        assert torch.equal(vocab.argmax(s_mtp.rows(1)), s_mtp_logits[:, 1:].argmax(-1).reshape(-1))
        mtp_self = vocab.kl_sum(s_last.rows(1), s_mtp.rows(1))
        torch.testing.assert_close(mtp_self, metrics.kl(s_logits[:, 1:], s_mtp_logits[:, 1:]).sum(), rtol=1e-6,
                                   atol=0)


class _SGD(Schedule):
    """Plain gradient descent: Adam's first steps divide each gradient by its own size, which turns rounding in
    a gradient of ~1e-9 (an expert's, a router's) into a step of the learning rate's size either way."""

    def optimizer(self, model):
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=self.lr)


def test_a_distillation_with_chunked_losses_trains_the_weights_of_the_whole_logits(parent, small_chunks):
    """The built-in kl, lm and mtp terms against the same terms registered through the whole logits: the
    same trained weights after a few steps, to float tolerance."""
    for name, fn in WHOLE.items():
        register_loss(f"whole-{name}")(fn)
    register_optimizer("test-sgd")(lambda d: _SGD(d.steps, d.lr, warmup=d.warmup))
    settings = dict(steps=4, batch=3, seq=24, eval_every=2, eval_windows=2, warmup=1, lr=0.5, cos=0.5,
                    temperature=1.5, keep_best=False, optimizer="test-sgd")
    chunked, whole = (_child(parent) for _ in range(2))
    distill(chunked, parent, Distill(kl=1.0, lm=0.3, mtp=0.7, **settings))
    distill(whole, parent, Distill(kl=0.0, lm=0.0, mtp=0.0, loss=["whole-kl:1.0", "whole-lm:0.3", "whole-mtp:0.7"],
                                   **settings))
    moved, start = 0, _child(parent)
    for name in chunked.weights.names():
        a, w = chunked.weights.get(name), whole.weights.get(name)
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6 * max(1.0, w.abs().max().item()), msg=name)
        moved += not torch.equal(a, start.weights.get(name))
    assert moved > 10  # the run trained


def _child(parent):
    prog = parent.copy()
    PassManager("set-topk{k=1},drop-blocks{layers=[2]}").run(prog)
    for name in prog.weights.names():
        prog.weights.set(name, prog.weights.get(name).clone())
    return prog


def test_the_window_metrics_over_chunks_equal_the_whole_logits(parent, small_chunks):
    """eval's figures (bits per byte, KL and top-1 to a teacher, the MTP head's accuracy), from a model and from its
    stream, against the definitions applied to whole logits."""
    from puzzlekit.backends.torch.stream import StreamedProgram

    student = _student(parent).eval()
    teacher = materialize(parent)
    windows = torch.randint(0, 256, (3, 25), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        t_logits, _ = teacher(windows)
        s_logits, s_mtp = student(windows)
    nll = metrics.nll(s_logits[:, :-1], windows[:, 1:]).sum().item()
    kl = metrics.kl(t_logits, s_logits).mean().item()
    agree = (t_logits.argmax(-1) == s_logits.argmax(-1)).float().mean().item()
    mtp = (s_mtp[:, 1:-1].argmax(-1) == windows[:, 2:]).float().mean().item()
    for t in (teacher, StreamedProgram(parent)):
        got = metrics.teacher_agreement(t, student, windows, batch=2)
        assert got["kl"] == pytest.approx(kl, rel=1e-5) and got["top1_agreement"] == pytest.approx(agree, abs=1e-6)
    text = metrics.text_metrics(student, windows, batch=2)
    assert text["nll_per_token"] * windows[:, 1:].numel() == pytest.approx(nll, rel=1e-6)
    assert text["mtp_top1_accuracy"] == pytest.approx(mtp, abs=1e-6)
