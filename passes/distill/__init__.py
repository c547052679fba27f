"""Global knowledge distillation: the current program (the student) learns its teacher's outputs.

Every part of a run is looked up by name in a registry that users extend the same way the built-ins
are registered: loss terms (`register_loss`), data sources (`register_data`), optimiser/schedule
factories (`register_optimizer`) and callbacks (`register_callback`). The loop itself is the shared one
(`training.fit`): resumable from atomic checkpoints, and data-parallel under `torchrun` (gloo on CPU, NCCL
on GPUs), where each process takes its slice of the same global batch. The forward runs in the pass's
compute dtype (bf16 autocast by default on CUDA), the master weights, optimizer state and losses in float32.

Scaling up (see `Distill`):

- `shard=ddp` (and `auto`, today) replicates the student on every process (DDP); `shard=fsdp` shards it with
  PyTorch FSDP2 (`shard_model`), the teacher the same way; its checkpoints are `torch.distributed.checkpoint`
  directories that resume on any number of processes.
- `accumulate=n` runs each process's slice of the global batch as n micro-batches (the same step).
- `checkpointing=true` recomputes each block's activations in the backward (the same numbers, less memory).
- `teacher_logits=DIR` stores the teacher's top-`topk` log-probabilities of every step's batch once
  (`TeacherStore`), so training needs no teacher in memory.
- State that fits one node: `params=bf16` holds the blocks' parameters and gradients in bfloat16, with
  `optimizer=adamw-bf16` (bfloat16 moments) or `adamw-8bit` (torchao's) rounding updates stochastically;
  `offload=true` keeps FSDP2's shards and optimizer state in host memory; the kept best weights wait in host
  memory, or on disk with `best=disk`; `teacher_dtype=fp8` holds the live teacher's matmul weights in FP8.
  `training.state_bytes` gives each configuration's bytes per parameter.

The package, by concern: `registries` (the registries, what a loss term sees, the built-in terms, data
source and optimiser), `optimizers` (the optimisers whose state fits, the state options' checks),
`evaluator` (held-out evaluation, keep-best), `sharding` (building, FSDP2, activation checkpointing, the
FP8 teacher), `teacher_store` (the stored top-k's disk format), `run` (`distill()`); this module holds the
`Distill` pass and re-exports their names. Importing it registers the built-ins.
"""
from __future__ import annotations

import sys
from dataclasses import field, replace
from pathlib import Path
from typing import ClassVar

from ..core import ComputePass, PassError, Preserved, pipeline_data, register
from ..manager import reporting
# re-exported for importing; to replace one (a test's monkeypatch), set it on its own module, which is where
# the others look it up (e.g. sharding.shard_model, teacher_store.CHUNK_BYTES)
from .evaluator import Evaluator
from .optimizers import adamw_8bit, adamw_bf16, check_options
from .registries import (CALLBACKS, DATA, LOSSES, OPTIMIZERS, Batch, Outputs, Source, adamw_cosine, cosine_loss,
                         kl_loss, lm_loss, mtp_loss, mtp_self_loss, register_callback, register_data, register_loss,
                         register_optimizer, soft_kl, text_source, topk_kl)
from .run import _capture, _outputs, distill, parse_terms, teacher_program
from .sharding import SHARDS, checkpoint_blocks, full_state, shard_model
from .teacher_store import CHUNK_BYTES, TeacherStore

__all__ = [
           "CALLBACKS",
           "CHUNK_BYTES",
           "DATA",
           "Batch",
           "Distill",
           "Evaluator",
           "LOSSES",
           "OPTIMIZERS",
           "Outputs",
           "SHARDS",
           "Source",
           "TeacherStore",
           "adamw_8bit",
           "adamw_bf16",
           "adamw_cosine",
           "checkpoint_blocks",
           "cosine_loss",
           "distill",
           "full_state",
           "kl_loss",
           "lm_loss",
           "mtp_loss",
           "mtp_self_loss",
           "parse_terms",
           "register_callback",
           "register_data",
           "register_loss",
           "register_optimizer",
           "shard_model",
           "soft_kl",
           "teacher_program",
           "text_source",
           "topk_kl",
]


@register("distill")
class Distill(ComputePass):
    """Recover quality by knowledge distillation from a teacher (a snapshot or a checkpoint path).

    Under `torchrun` each process takes its slice of the same global `batch` (so the result does not depend
    on the process count). `shard`: `ddp` replicates the student on every process and all-reduces the
    gradients (DDP); `fsdp` shards parameters, gradients and optimizer state (float32 master weights) over
    the processes with FSDP2, and the teacher's parameters too, for a model one device cannot train; its
    checkpoints (`state=`) are sharded and resume on any number of processes; with one process it runs
    unsharded through the same loop and checkpoint format. `auto` is ddp for now (the models puzzlekit
    distills fit one device; choose fsdp explicitly). `accumulate=n` splits each process's rows into n
    micro-batches with one optimizer step (the same step as one big batch); `checkpointing=true`
    recomputes block activations in the backward. `teacher_logits=DIR` computes the teacher's top-`topk`
    next-token log-probabilities for every step once (streamed layer by layer), stores them in DIR, and
    trains from them without a teacher in memory: the KL is then over the teacher's renormalised top-k
    (`topk_kl`; exact at topk = vocabulary), and the cos and mtp terms, which need the live teacher, must be
    set to 0. Neither `shard`, `accumulate` nor `checkpointing` is part of what a resumed run must match.

    State that fits (bytes per parameter: `training.state_bytes`): `params=bf16` holds every block's
    parameters (the trunk's and the MTP head's mixers: all FSDP shards as block groups) and so their
    gradients in bfloat16, the embedding, LM head and final norms in float32; it needs a bfloat16 forward
    and an optimizer that rounds stochastically: `optimizer=adamw-bf16` (AdamW, bfloat16 moments) or
    `adamw-8bit` (torchao's AdamW8bit: `pip install torchao`), both also usable with float32 parameters.
    `offload=true` (shard=fsdp) keeps the shards, gradients and optimizer state in host memory (FSDP2's
    CPUOffloadPolicy: the optimizer steps on the host). The kept best weights wait in host memory
    (`best=host`), or in the state directory (`best=disk`, needs `state=`), never on the device.
    `teacher_dtype=fp8` holds the live teacher's matmul weights in FP8 E4M3 with one scale per tensor,
    dequantised at each product (`auto`: the compute dtype). `params` and `teacher_dtype` change what is
    trained (a resumed run must match them); `offload` and `best` do not.

    `head_only=true` trains the MTP head alone on `mtp` (the teacher's head) and `mtp_self` (the student's own
    trunk, which verifies the head's drafts: after pruning the teacher's head answers for another trunk), and
    keeps the weights of least MTP loss on the selection set (`selected_on` in the report: the trunk KL it
    cannot move would keep its starting weights).
    """

    teacher: str = "teacher"
    steps: int = 200
    lr: float = 3e-4
    warmup: int = 10
    batch: int = 8
    seq: int = 128
    kl: float = 1.0
    cos: float = 1.0
    lm: float = 0.0
    mtp: float = 1.0
    mtp_self: float = 0.0  # the head against the student's own trunk (`mtp-self`): what drafts are verified by
    temperature: float = 1.0
    loss: list[str] = field(default_factory=list)  # more registered terms: name or name:weight
    source: str = "text"
    data: list[str] = field(default_factory=list)
    optimizer: str = "adamw-cosine"
    callbacks: list[str] = field(default_factory=list)
    eval_every: int = 50
    eval_windows: int = 16
    keep_best: bool = True
    state: str = ""  # a directory for resumable checkpoints ("" : none)
    checkpoint_every: int = 50
    seed: int = 0
    head_only: bool = False  # train only the MTP head's own weights (after the trunk is final); keeps the
    # weights of least MTP loss (mtp * mtp_kl + mtp_self * mtp_self_kl) on the selection set, not the trunk KL
    # scaling up: how the student is spread over the torchrun processes (auto: ddp; see below)
    shard: str = "auto"
    checkpointing: bool = False  # recompute each block's activations in the backward (less memory, same numbers)
    accumulate: int = 1  # micro-batches per step: each process's rows of the global batch in this many parts
    teacher_logits: str = ""  # a directory of the teacher's stored top-k logits ("": run the teacher live)
    topk: int = 64  # how many of the teacher's log-probabilities per token teacher_logits stores
    # state that fits one node (see above)
    params: str = "fp32"  # the blocks' trained parameters and gradients: fp32, or bf16
    offload: bool = False  # shard=fsdp: shards, gradients and optimizer state in host memory
    best: str = "host"  # where the kept best weights wait: host (memory) or disk (the state directory)
    teacher_dtype: str = "auto"  # the live teacher's matmul weights: auto (the compute dtype), or fp8
    minimum: ClassVar[dict] = {"steps": 1, "batch": 1, "seq": 2, "eval_every": 1, "eval_windows": 1,
                               "checkpoint_every": 1, "warmup": 0, "lr": 1e-12, "temperature": 1e-6,
                               "accumulate": 1, "topk": 1}

    def __post_init__(self):
        super().__post_init__()
        if self.shard not in SHARDS:
            raise PassError(f"pass 'distill': shard={self.shard!r} is not one of {', '.join(SHARDS)} (ddp: a replica "
                            "per process; fsdp: parameters, gradients and optimizer state sharded over them)")
        check_options(self)

    def run(self, prog, am):
        if self.head_only and not prog.find("mtp"):  # compress's recovery stage, on a model without a head
            print("distill: head_only=true, and the model has no MTP head: nothing to train", file=sys.stderr)
            return Preserved.all()
        state_dir = None
        if self.state:
            state_dir = Path(self.state)
            rounds = getattr(am, "round", (1, 1))
            if rounds[1] > 1:  # each round of repeat{...} resumes its own run
                state_dir = state_dir / f"round{rounds[0]}"
            state_dir.mkdir(parents=True, exist_ok=True)
        settings = replace(self, data=pipeline_data(self.data, am))
        report = distill(prog, teacher_program(self.teacher, am), settings, state_dir, reporting(am),
                         self.compute(am))
        am.reports.setdefault("distill", []).append(report)
        return Preserved.structure_only()
