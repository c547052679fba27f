"""Metrics of decoding: the MTP head's speculative acceptance length (from the decode state, verifying each
draft as one chunk) and decode throughput at a batch and context."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..errors import PuzzlekitError
from .metrics import _checked


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
def acceptance_length(model, prompts: torch.Tensor, k: int, new_tokens: int, drafter: Drafter | None = None,
                      decode_first: bool | None = None) -> float:
    """Mean tokens produced per trunk verification step of greedy self-speculative decoding.

    Each step takes the trunk's next token, drafts k more, and keeps the drafts up to the first that
    differs from the trunk's own greedy choice: a perfect drafter gives k + 1, a useless one 1. The trunk runs
    from its decode state (as a serving engine does): a prompt is read once, each step verifies its k + 1
    tokens as one chunk, and a rejection re-reads just the kept ones from the state before the step. Where most
    first drafts fail (`decode_first`; None: from the fifth step on, while more than half of the steps so far
    kept none), a step decodes the trunk's next token alone first and verifies the drafts only if the first one
    holds: one trunk pass for a step that keeps no draft instead of two. The figure is the same either way. The
    default drafter is the MTP head, from the same state."""
    draft = _cached_mtp_drafter(model) if drafter is None else (lambda seq, bonus, k, state: drafter(seq, bonus, k))
    lengths, kept_some = [], 0
    for prompt in prompts:
        seq = prompt.clone()
        outs, state = model.prefill(seq[None])
        bonus = int(_checked(outs, model, "")[0][0, -1].argmax())
        produced = 0
        while produced < new_tokens:
            drafts = draft(seq, bonus, k, state)
            alone = decode_first if decode_first is not None else len(lengths) >= 4 and 2 * kept_some < len(lengths)
            accepted, state, after = (_next_first if alone else _chunk)(model, state, bonus, drafts)
            kept_some += accepted > 0
            lengths.append(accepted + 1)
            seq = torch.cat([seq, torch.tensor([bonus, *drafts[:accepted]], dtype=seq.dtype)])
            bonus = after
            produced += accepted + 1
    return float(np.mean(lengths))


def _chunk(model, state, bonus: int, drafts: list[int]) -> tuple[int, tuple, int]:
    """The trunk's next token and the drafts verified as one chunk: (drafts kept, the state after the kept
    tokens, the trunk's token after them)."""
    chunk = torch.tensor([[bonus, *drafts]])
    outs, verified = model.prefill(chunk, state)
    greedy = _checked(outs, model, "")[0][0].argmax(-1).tolist()  # after bonus, d1, ..., dk
    accepted = _kept(drafts, greedy)
    if accepted < len(drafts):  # the state after the kept tokens alone (one token: the recurrent decode step)
        kept = chunk[:, : accepted + 1]
        verified = model.decode(kept[:, 0], state)[1] if accepted == 0 else model.prefill(kept, state)[1]
    return accepted, verified, greedy[accepted]


def _next_first(model, state, bonus: int, drafts: list[int]) -> tuple[int, tuple, int]:
    """As `_chunk`, with the trunk's next token decoded alone first and the drafts verified only if the first
    draft is what the trunk chose."""
    outs, after = model.decode(torch.tensor([bonus]), state)
    first = int(_checked(outs, model, "")[0][0, -1].argmax())
    if first != drafts[0]:
        return 0, after, first
    chunk = torch.tensor([drafts])
    outs, verified = model.prefill(chunk, after)
    greedy = [first, *_checked(outs, model, "")[0][0].argmax(-1).tolist()]  # after bonus, d1, ..., dk
    accepted = _kept(drafts, greedy)
    if accepted < len(drafts):
        kept = chunk[:, :accepted]
        verified = model.decode(kept[:, 0], after)[1] if accepted == 1 else model.prefill(kept, after)[1]
    return accepted, verified, greedy[accepted]


def _kept(drafts: list[int], greedy: list[int]) -> int:
    """The drafts kept: up to the first that differs from the trunk's greedy choice."""
    return next((i for i, (d, g) in enumerate(zip(drafts, greedy)) if d != g), len(drafts))


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
    from ..backends.torch.device import median_seconds

    _, state = model.prefill(ids)
    tok = ids[:, -1].to(model.compute.device)
    return batch / median_seconds(lambda: model.decode(tok, state), model.compute, repeats, warmup)
