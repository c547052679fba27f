"""Evaluation metrics: bits per byte, agreement with a teacher, MTP accuracy, speculative acceptance length,
decode throughput. The one definition of each: distillation's loss terms and evaluations, the library's scores,
every report and benchmark compute theirs here, so that their figures mean the same thing."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .errors import PuzzlekitError

LN2 = math.log(2.0)


class NonFiniteError(PuzzlekitError):
    """A model produced NaN or inf: a metric computed from it would be meaningless."""


def check_finite(values, what: str, model=None):
    """Returns `values` (a tensor or array) when all finite; otherwise raises NonFiniteError naming the
    likely cause: `model`'s non-finite parameters when it has some, else an overflowing activation."""
    finite = torch.isfinite(values).all() if isinstance(values, torch.Tensor) else np.isfinite(values).all()
    if finite:
        return values
    if not hasattr(model, "named_parameters"):
        cause = "its weights may hold NaN/inf"
    elif bad := [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]:
        cause = f"its weights hold NaN/inf ({', '.join(bad[:3])}{f' and {len(bad) - 3} more' if len(bad) > 3 else ''})"
    else:
        cause = "its parameters are finite, so an activation overflowed (or a quantized weight is NaN/inf)"
    raise NonFiniteError(f"the model produced NaN/inf {what}: {cause}; check a checkpoint with "
                         "`puzzlekit inspect --check-finite`")


# -- per position: the math every figure below is made of ----------------------------------------------------
def kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions softened by `temperature`, nats per position
    (logits [..., vocab]; float32 whatever their dtype)."""
    t = F.log_softmax(teacher_logits.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1)
    return (t.exp() * (t - s)).sum(-1)


def topk_kl(values: torch.Tensor, indices: torch.Tensor, student_logits: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """`kl` from the teacher's stored top-k alone: `values` its full-vocabulary log-probabilities at `indices`
    [..., k]. The teacher's distribution is renormalised over its top k (softened by the temperature there:
    exact, as softmax(logits / T) restricted to those tokens), the student's is its full log_softmax gathered
    at the same indices:

        sum_i p_i (log p_i - log q_i),  p = softmax(values / T) over the k,  q = softmax(student / T) over all

    An approximation: the teacher's mass outside its top k is dropped (the value is still >= 0, and least when
    the student puts the teacher's top-k proportions on those tokens and nothing elsewhere); with k = the
    vocabulary it is `kl`."""
    t = F.log_softmax(values.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1).gather(-1, indices.long())
    return (t.exp() * (t - s)).sum(-1)


def agrees(teacher_top1: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Per position, whether the student's most likely next token is the teacher's (`teacher_top1`: its
    argmax, or the first of its stored top-k)."""
    return student_logits.argmax(-1) == teacher_top1.to(student_logits.device)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `targets` [...] under `logits` [..., vocab], nats per position (float32); over a byte
    vocabulary its mean / LN2 is bits per byte."""
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           targets.reshape(-1).to(logits.device), reduction="none")
    return flat.view(targets.shape)


def _batches(windows: torch.Tensor, batch: int):
    for i in range(0, len(windows), batch):
        yield windows[i:i + batch]


def _checked(out, model, who: str):
    out = out if isinstance(out, tuple) else (out, None)
    for name, t in zip(("logits", "MTP logits"), out):
        if t is not None:
            check_finite(t, f"{name}{who}", model)
    return out


def _outputs(model, ids, who: str = ""):
    return _checked(model(ids), model, who)


def _forward(model, windows: torch.Tensor, batch: int, who: str = ""):
    """(ids, logits, MTP logits or None) per batch of windows. A streamed model (backends.torch.stream)
    runs all the windows through one layer before reading the next."""
    if not hasattr(model, "outputs"):
        for ids in _batches(windows, batch):
            yield ids, *_outputs(model, ids, who)
        return
    for rows, out in model.outputs(windows, batch):
        vals = tuple(out.values())
        yield windows[rows], *_checked(vals if len(vals) > 1 else vals[0], model, who)


@torch.no_grad()
def text_metrics(model, windows: torch.Tensor, token_bytes=None, batch: int = 8) -> dict:
    """Next-token cross-entropy over every position of windows [n, T] of token ids: bits per byte (the summed NLL
    in bits over the UTF-8 bytes the scored tokens stand for, `token_bytes[id]`; None: one byte per token, the
    byte codec), NLL per token (nats) and perplexity. Bits per byte compares models across tokenizers. With an
    MTP head, from the same pass, its top-1 accuracy (`mtp_accuracy`'s figure)."""
    total, count, nbytes, mtp_hit, mtp_count = 0.0, 0, 0, 0, 0
    for ids, logits, mtp in _forward(model, windows, batch):
        total += nll(logits[:, :-1], ids[:, 1:]).sum().item()
        count += ids[:, 1:].numel()
        nbytes += count_bytes(ids[:, 1:], token_bytes)
        if mtp is not None:
            hit, n = _mtp_hits(ids, mtp)
            mtp_hit, mtp_count = mtp_hit + hit, mtp_count + n
    if nbytes == 0:
        raise PuzzlekitError("the scored tokens stand for no text (only special tokens): bits per byte is undefined")
    return {"bits_per_byte": total / nbytes / LN2, "nll_per_token": total / count,
            "perplexity": math.exp(min(total / count, 700.0)), "tokens": count, "bytes": nbytes,
            **({"mtp_top1_accuracy": mtp_hit / mtp_count} if mtp_count else {})}


def count_bytes(ids: torch.Tensor, token_bytes=None) -> int:
    """UTF-8 bytes the token ids stand for (`token_bytes` per id; None: one each)."""
    if token_bytes is None:
        return ids.numel()
    return int(np.asarray(token_bytes)[ids.reshape(-1).cpu().numpy()].sum())


def bits_per_byte(model, windows: torch.Tensor, batch: int = 8, token_bytes=None) -> float:
    """`text_metrics`' bits per byte."""
    return text_metrics(model, windows, token_bytes, batch)["bits_per_byte"]


def unigram_bits_per_byte(train: np.ndarray, windows: torch.Tensor, vocab: int = 256, token_bytes=None) -> float:
    """The baseline: token frequencies of the training text (add-one smoothed over the vocabulary), scored like
    bits_per_byte."""
    p = (np.bincount(train, minlength=vocab)[:vocab] + 1.0) / (len(train) + float(vocab))
    targets = windows[:, 1:].reshape(-1).numpy()
    return float(-np.log2(p[targets]).sum()) / count_bytes(windows[:, 1:], token_bytes)


@torch.no_grad()
def teacher_agreement(teacher, student, windows: torch.Tensor, batch: int = 8) -> dict:
    """KL(teacher || student) of the next-token distributions (nats per token) and top-1 agreement."""
    total, agree, count = 0.0, 0, 0
    for (ids, t, _), (_, s, _) in zip(_forward(teacher, windows, batch, " (teacher)"),
                                      _forward(student, windows, batch, " (student)")):
        total += kl(t, s).sum().item()
        agree += agrees(t.argmax(-1), s).sum().item()
        count += ids.numel()
    return {"kl": total / count, "top1_agreement": agree / count}


@torch.no_grad()
def mtp_accuracy(model, windows: torch.Tensor, batch: int = 8) -> float:
    """Top-1 accuracy of the MTP head: its logits at t predict byte t+1 from the trunk's state at t-1.

    Position 0 (which sees a zero trunk state) is left out.
    """
    hit, count = 0, 0
    for ids, _, mtp in _forward(model, windows, batch):
        if mtp is None:
            raise ValueError("the model has no MTP head")
        h, n = _mtp_hits(ids, mtp)
        hit, count = hit + h, count + n
    return hit / count


def _mtp_hits(ids: torch.Tensor, mtp: torch.Tensor) -> tuple[int, int]:
    """(positions whose MTP top-1 is the token after next, positions scored): position 0 left out."""
    return (mtp[:, 1:-1].argmax(-1).cpu() == ids[:, 2:]).sum().item(), ids[:, 2:].numel()


# -- self-speculative decoding -------------------------------------------------------------------------------
Drafter = Callable[[torch.Tensor, int, int], list[int]]


def mtp_drafter(model) -> Drafter:
    """Drafts with the model's MTP head: the head's own pre-norm output stands in for the trunk state of a
    drafted token, so one head drafts k tokens in a row."""
    node = next(n for n in model.program.nodes if n.op.kind == "mtp")
    head = model.get_submodule(node.path)
    trunk_value = node.args[0]

    @torch.no_grad()
    def draft(seq: torch.Tensor, bonus: int, k: int) -> list[int]:
        h = model.values(seq[None], trunk_value)  # [1, n, hidden], on the model's device
        ids = torch.cat([seq, torch.tensor([bonus])])[None].to(h.device)
        out = []
        for _ in range(k):  # position j reads the state of j-1: h is one shorter than ids, pad its end
            with model.compute.autocast():
                logits, z = head.with_hidden(torch.cat([h, h[:, -1:]], dim=1), ids)
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            h = torch.cat([h, z[:, -1:]], dim=1)
            ids = torch.cat([ids, torch.tensor([[tok]], device=ids.device)], dim=1)
        return out

    return draft


def _state_slice(model, kind: str) -> slice:
    """Where the node of `kind`'s decode state lies in the flat state tuple (see ProgramModule.state_names)."""
    i = 0
    for n in model.program.nodes:
        cnt = len(n.op.state_shapes()) if n.op.is_block or n.op.kind == "mtp" else 0
        if n.op.kind == kind:
            return slice(i, i + cnt)
        i += cnt
    raise ValueError(f"the model has no {kind} node")


def _cached_mtp_drafter(model):
    """The MTP head drafting from the decode state: the head's own state after the committed tokens (its KV
    cache, the trunk state of the last one), then one head step per draft, its output standing in for the trunk
    state of the drafted token. Drafts what `mtp_drafter` drafts, without running the sequence again."""
    node = next(n for n in model.program.nodes if n.op.kind == "mtp")
    head, where = model.get_submodule(node.path), _state_slice(model, "mtp")

    def draft(seq, bonus: int, k: int, state) -> list[int]:
        hs = tuple(state[where])
        tok, out = bonus, []
        for _ in range(k):
            ids = torch.tensor([[tok]], device=hs[0].device)
            with model.compute.autocast():
                z, st = head._stack(hs[0][:, None], ids, hs, True)
                logits = head.shared[1](head.layers[-1].final_layernorm(z))
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            hs = (z[:, -1], *st[1:])
        return out

    return draft


@torch.no_grad()
def acceptance_length(model, prompts: torch.Tensor, k: int, new_tokens: int, drafter: Drafter | None = None) -> float:
    """Mean tokens produced per trunk verification step of greedy self-speculative decoding.

    Each step takes the trunk's next token, drafts k more, and keeps the drafts up to the first that
    differs from the trunk's own greedy choice: a perfect drafter gives k + 1, a useless one 1. The trunk runs
    from its decode state (as a serving engine does): a prompt is read once, each step verifies its k + 1
    tokens as one chunk, and a rejection re-reads just the kept ones from the state before the step. The
    default drafter is the MTP head, from the same state."""
    draft = _cached_mtp_drafter(model) if drafter is None else (lambda seq, bonus, k, state: drafter(seq, bonus, k))
    lengths = []
    for prompt in prompts:
        seq = prompt.clone()
        outs, state = model.prefill(seq[None])
        bonus = int(_checked(outs, model, "")[0][0, -1].argmax())
        produced = 0
        while produced < new_tokens:
            drafts = draft(seq, bonus, k, state)
            chunk = torch.tensor([[bonus] + drafts])
            outs, verified = model.prefill(chunk, state)
            greedy = _checked(outs, model, "")[0][0].argmax(-1).tolist()  # after bonus, d1, ..., dk
            accepted = 0
            while accepted < k and drafts[accepted] == greedy[accepted]:
                accepted += 1
            lengths.append(accepted + 1)
            kept = chunk[:, : accepted + 1]
            if accepted < k:  # the state after the kept tokens alone (one token: the recurrent decode step)
                state = model.decode(kept[:, 0], state)[1] if accepted == 0 else model.prefill(kept, state)[1]
            else:
                state = verified
            seq = torch.cat([seq, kept[0]])
            bonus = greedy[accepted]
            produced += accepted + 1
    return float(np.mean(lengths))


# -- speed ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def decode_throughput(model, batch: int, context: int, repeats: int = 15, warmup: int = 3, seed: int = 0) -> float:
    """Tokens per second of one decode step of `batch` sequences after a `context`-token prefill: the median
    over `repeats` timed steps (after `warmup` untimed ones), each from the same state, on seeded random ids.
    `model` a materialized program (backends.torch.materialize). The one measurement of speed, so that every
    measured throughput is comparable."""
    if batch < 1 or context < 1 or repeats < 1 or warmup < 0:
        raise PuzzlekitError(f"decode_throughput needs batch, context and repeats >= 1 and warmup >= 0 (got batch "
                             f"{batch}, context {context}, repeats {repeats}, warmup {warmup})")
    vocab = model.program.find("embed")[0].op.vocab
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))
    from .backends.torch.device import median_seconds

    _, state = model.prefill(ids)
    tok = ids[:, -1].to(model.compute.device)
    return batch / median_seconds(lambda: model.decode(tok, state), model.compute, repeats, warmup)
