"""MTP-head retention: the head must still draft well for the trunk it is attached to.

`mtp-check` measures the mean acceptance length of greedy self-speculative decoding (the MTP head drafts,
the trunk verifies; see evaluate.acceptance_length) on prompts from the held-out `report` set, for the
program and for the teacher snapshot, and fails the pipeline when the program's falls more than `tolerance`
below the teacher's. Recovery is `distill{head_only=true,mtp_self=1.0}`: it trains only the head's own weights,
on the teacher's head and on the trunk that verifies its drafts.
"""
from __future__ import annotations

import sys
from dataclasses import field
from typing import ClassVar

from .core import ComputePass, PassError, Preserved, pipeline_data, register
from .distill import teacher_program


def acceptance(prog, prompts, drafts: int, new_tokens: int, compute=None) -> float:
    from ..backends.torch.device import CPU
    from ..backends.torch.stream import StreamedProgram
    from ..evaluate import acceptance_length

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
        from ..data import corpus_for, held_out_windows
        from ..tokenizer import check_shared

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
