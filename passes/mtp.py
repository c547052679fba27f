"""MTP-head retention: the head must still draft well for the trunk it is attached to.

`mtp-check` measures the mean acceptance length of greedy self-speculative decoding (the MTP head drafts,
the trunk verifies; see evaluate.acceptance_length) on prompts from the held-out `report` set, for the
program and for the teacher snapshot, and fails the pipeline when the program's falls more than `tolerance`
below the teacher's. Recovery is `distill{head_only=true,mtp_self=1.0}`: it trains only the head's own weights,
on the teacher's head and on the trunk that verifies its drafts.

`mtp-match-attention` gives the head's attention the trunk's heads, for the engines that build the head's
attention (TensorRT-LLM) or its KV pool (SGLang) from the model's top-level fields: a search may prune the trunk's
attention, and the head then follows, before its recovery, from a start that keeps each query head's attention
as nearly as the merged KV heads allow.
"""
from __future__ import annotations

import sys
from dataclasses import field
from typing import ClassVar

import torch

from .core import ComputePass, Pass, PassError, Preserved, pipeline_data, register
from .distill import teacher_program


def acceptance(prog, prompts, drafts: int, new_tokens: int, compute=None) -> float:
    from ..backends.torch.device import CPU
    from ..backends.torch.stream import StreamedProgram
    from ..evaluation import acceptance_length

    if not prog.find("mtp"):
        raise PassError("mtp-check: the model has no MTP head")
    return acceptance_length(StreamedProgram(prog, compute or CPU), prompts, drafts, new_tokens)


@register("mtp-check")
class MTPCheck(ComputePass):
    """Compare the MTP head's speculative acceptance length with the teacher's; fail past `tolerance`."""

    teacher: str = "teacher"
    drafts: int = 3
    tolerance: float = 0.1  # the largest allowed relative drop below the teacher's acceptance length
    prompts: int = 8
    prompt_len: int = 64
    new_tokens: int = 32
    data: list[str] = field(default_factory=list)
    minimum: ClassVar[dict] = {"drafts": 1, "tolerance": 0.0, "prompts": 1, "prompt_len": 1, "new_tokens": 1}

    def run(self, prog, am):
        from ..text.data import corpus_for, held_out_windows
        from ..text.tokenizer import check_shared

        teacher = teacher_program(self.teacher, am)
        if not prog.find("mtp") and not teacher.find("mtp"):  # a model without a head (Nemotron-3-Nano) keeps none
            print("mtp-check: neither the model nor the teacher has an MTP head: nothing to check", file=sys.stderr)
            return Preserved.all()
        check_shared(prog, teacher)
        corpus = corpus_for(prog, pipeline_data(self.data, am) or None)
        prompts = held_out_windows(corpus, "report", self.prompt_len, limit=self.prompts)
        compute = self.compute(am)
        ours = acceptance(prog, prompts, self.drafts, self.new_tokens, compute)
        theirs = acceptance(teacher, prompts, self.drafts, self.new_tokens, compute)
        floor = theirs * (1 - self.tolerance)
        am.reports.setdefault("mtp-check", []).append(
            {"acceptance": ours, "teacher_acceptance": theirs, "drafts": self.drafts, "floor": floor})
        if ours < floor:
            raise PassError(f"the MTP head's mean acceptance length is {ours:.3f} tokens per step, below the "
                            f"teacher's {theirs:.3f} by more than tolerance={self.tolerance} (floor {floor:.3f}); "
                            "recover it with distill{head_only=true,mtp_self=1.0} before mtp-check")
        return Preserved.all()


@register("mtp-match-attention")
class MTPMatchAttention(Pass):
    """Shrink the MTP head's attention to the trunk's heads when `engine` builds the head's attention from the top
    level (tensorrt-llm and all: query heads, KV heads, head size; sglang: its KV pool's KV heads and head size):
    KV heads merged where the query heads stay (`_merge_kv`), else whole KV groups kept by the weight of their
    output columns."""

    engine: str = "all"

    def run(self, prog, am):
        from .puzzle.engines import get_engine

        head, profile = prog.find("mtp"), get_engine(self.engine)
        if not profile.head_from_top or not head:
            return Preserved.all()
        node = head[0]
        mine = [(i, b) for i, b in enumerate(node.op.blocks) if b.kind == "attention"]
        # the attributes the engines read from the top level: all three (TensorRT-LLM), or the KV pool's (SGLang)
        top = sorted({a for kind, names in profile.uniform if kind == "attention" for a in names})
        layers = [n.op for n in prog.find("attention")]
        if not mine or len({tuple(getattr(op, a) for a in top) for op in layers}) != 1:
            return Preserved.all()  # nothing to match (a trunk that differs by layer no such engine loads)
        blocks, weights = list(node.op.blocks), {}
        for i, b in mine:
            q, kv, d = profile.head_attention(layers[0], b)
            if (b.q_heads, b.kv_heads, b.head_dim) == (q, kv, d):
                continue
            if b.quant:
                raise PassError(f"mtp-match-attention: {node.path} is quantised; match its attention before quantize")
            axis = _matching(b, q, kv, d, node.path)
            local = {k: prog.weights.get(f"{node.path}.layers.{i}.{k}") for k in b.params()}
            if axis == "kv_merge":
                blocks[i], shrunk = _merge_kv(b, kv, local)
            else:  # the KV groups whose query heads write the most into the residual
                o = local["mixer.o_proj.weight"].float()
                keep = o.reshape(o.shape[0], b.kv_heads, -1).pow(2).sum((0, 2)).topk(kv).indices.sort().values
                blocks[i], shrunk = b.shrink(axis, keep, local)
            weights.update({f"layers.{i}.{k}": v for k, v in shrunk.items() if "_proj." in k})
        if not weights:
            return Preserved.all()
        prog.rewrite(node, op=node.op.replace(blocks=tuple(blocks)), weights=weights)
        am.reports.setdefault("mtp-match-attention", []).append({"path": node.path, "q_heads": q, "kv_heads": kv})
        print(f"mtp-match-attention: {node.path}'s attention now has the trunk's {q} query / {kv} KV heads; "
              "recover the head with distill{head_only=true}", file=sys.stderr)
        return Preserved.none()  # the head's spec and its tensors both changed


def _merge_kv(b, kv: int, w: dict):
    """Attention block `b` with its KV heads merged into `kv`, each query head keeping its scores and values as
    nearly as a shared head allows: the merged K (and V) projection spans the top `head_dim` right singular vectors
    of its group's stacked projections, and each old head's map onto it (K_g ~ M_g K', V_g ~ N_g V') moves into
    that head's queries (q -> M_g^T q) and output columns (o -> o N_g). No positional encoding sits between, so
    the scores are q.k exactly as before wherever the group's projections span `head_dim` rows; the mean merge
    (Puzzle's GQA reduction) is the special case M_g = N_g = I."""
    D, H, r = b.head_dim, b.hidden, b.kv_heads // kv
    rep = b.q_heads // b.kv_heads
    out = {k: v.clone() for k, v in w.items()}
    q = out["mixer.q_proj.weight"].reshape(b.kv_heads, rep, D, H)
    o = out["mixer.o_proj.weight"].reshape(H, b.kv_heads, rep, D)
    merged = {}
    for name, into in (("k", "q"), ("v", "o")):
        proj = w[f"mixer.{name}_proj.weight"]
        old = proj.double().reshape(kv, r, D, H)
        new = []
        for j in range(kv):
            _, sv, vt = torch.linalg.svd(old[j].reshape(r * D, H), full_matrices=False)
            shared = (sv[:D, None] / r ** 0.5) * vt[:D]  # [D, H], the scale of the mean merge
            new.append(shared)
            for g in range(r):
                m = old[j, g] @ torch.linalg.pinv(shared)  # [D, D]: K_g ~ m @ K'
                h = j * r + g
                if into == "q":
                    q[h] = (m.T @ q[h].double()).to(q.dtype)
                else:
                    o[:, h] = (o[:, h].double() @ m).to(o.dtype)
        merged[name] = torch.cat(new).to(proj.dtype)
    out["mixer.k_proj.weight"], out["mixer.v_proj.weight"] = merged["k"], merged["v"]
    out["mixer.q_proj.weight"] = q.reshape(b.q_heads * D, H)
    out["mixer.o_proj.weight"] = o.reshape(H, b.q_heads * D)
    return b.replace(kv_heads=kv), out


def _matching(b, q: int, kv: int, d: int, where: str) -> str:
    """The axis whose shrink takes the head's attention block `b` to q query / kv KV heads of size d (the search
    offers no trunk attention it cannot reach: EngineProfile.head_cannot_follow)."""
    from .puzzle.engines import head_match_axis

    if axis := head_match_axis(b, q, kv, d):
        return axis
    raise PassError(f"mtp-match-attention: {where} has attention of {b.q_heads} query / {b.kv_heads} KV heads of "
                    f"{b.head_dim}, the trunk {q} / {kv} of {d}; only merging or dropping whole KV groups reaches "
                    "it: prune the trunk's attention that way, or serve with an engine that reads the head's own "
                    "fields (--engine vllm or sglang)")
