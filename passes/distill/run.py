"""The distillation run itself: `distill()` (checks the settings, builds the student and the teacher or
reads the stored logits, and trains through `training.fit`), the block-output capture the loss terms
see, the loss weights, and `teacher_program` (the teacher a pipeline names). It ties the other modules
together and none of them imports it. (`Distill` in annotations is the pass, `passes.distill.Distill`:
not imported, since the package imports this module.)"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ...evaluation import metrics
from ...evaluation.vocab import Hidden
from ...backends.torch.device import CPU, Compute
from ...ir import Program
from ...ir.identity import program_hash
from ...text.tokenizer import check_shared, tokenizer_of
from ...training import FileCheckpoint, ShardedCheckpoint, distributed, fit
from ..core import PassError
from .evaluator import Evaluator
from .registries import CALLBACKS, DATA, LOSSES, OPTIMIZERS, Batch, Outputs
from .optimizers import resumable
from .sharding import _build, _fsdp_available, _reshard, full_state
from .teacher_store import TeacherStore

#: the head's loss terms and the held-out metric each is (Evaluator.measure): a head-only run selects on them
HEAD_METRICS = {"mtp": "mtp_kl", "mtp-self": "mtp_self_kl"}


# -- the run ---------------------------------------------------------------------------------------------------------
def _capture(model) -> tuple[list, Callable]:
    """Hooks that record every block's output on each forward; returns (the list, the undo function)."""
    seen: list[torch.Tensor] = []
    hooks = [model.get_submodule(n.path).register_forward_hook(lambda m, a, out: seen.append(out[0]))
             for n in model.program.blocks()]
    return seen, lambda: [h.remove() for h in hooks]


def _outputs(net, seen: list, x: torch.Tensor, compute: Compute = CPU) -> Outputs:
    """The model's final hidden states (and its MTP head's) with the LM head's matrix, not its logits: the loss
    terms build those a chunk of tokens at a time, in `compute`'s precision (evaluation.vocab)."""
    seen.clear()
    *states, weight = net(x, project=False)
    heads = [Hidden(h, weight, compute.autocast) for h in states]
    return Outputs(heads[0], heads[1] if len(heads) > 1 else None, list(seen))


def parse_terms(d: Distill, head: bool = True) -> dict[str, float]:
    """The loss weights: the built-in options, then `loss=[name:weight,...]`; unknown names are refused. A
    student without an MTP head (`head` false: Nemotron-3-Nano, the dense Nemotron-H) has no head terms: the
    built-in `mtp` and `mtp_self` options do not apply to it (a head term named in `loss=` still fails)."""
    weights = {"mtp": d.mtp} if d.head_only else {"kl": d.kl, "cos": d.cos, "lm": d.lm, "mtp": d.mtp}
    weights["mtp-self"] = d.mtp_self
    if not head:
        weights = {n: w for n, w in weights.items() if n not in ("mtp", "mtp-self")}
    for item in d.loss:
        name, _, w = item.partition(":")
        try:
            weights[name] = float(w) if w else 1.0
        except ValueError:
            raise PassError(f"distill: loss={item!r}: the weight after ':' must be a number") from None
    unknown = [n for n in weights if n not in LOSSES]
    if unknown:
        raise PassError(f"distill: unknown loss term(s) {unknown}; registered: {', '.join(sorted(LOSSES))} "
                        "(register one with puzzlekit.passes.distill.register_loss)")
    return {n: w for n, w in weights.items() if w}


def _lookup(table: dict, name: str, what: str, option: str):
    if name not in table:
        raise PassError(f"distill: unknown {what} {name!r} ({option}=); registered: {', '.join(sorted(table))}")
    return table[name]


def teacher_program(name: str, am) -> Program:
    """A snapshot taken earlier in the pipeline, or a checkpoint path."""
    if name in am.snapshots:
        return am.snapshots[name]
    if Path(name).exists():
        from ...ir import load

        return load(name)
    raise PassError(f"distill: teacher {name!r} is neither a snapshot ({', '.join(am.snapshots) or 'none taken'}) "
                    "nor a checkpoint path; add snapshot{name=" + name + "} before the passes that change the model")


def distill(prog: Program, teacher_prog: Program, d: Distill, state_dir: Path | None = None,
            progress: bool | str = False, compute: Compute = CPU) -> dict:
    """Trains `prog`'s weights in place against `teacher_prog` on `compute`'s device and precision; returns
    the run's report. `progress`: a bar, or lines in a log (eta.Remaining), on rank 0."""

    if prog.is_meta or teacher_prog.is_meta:
        raise PassError("distill needs weights: the student or the teacher was loaded from a bare config")
    quantized = [n.path for n in prog.nodes if n.op.quant]
    if quantized:
        raise PassError(f"distill trains full-precision weights, but {quantized[0]} is quantized; "
                        "distill before the quantize pass")
    terms = parse_terms(d, bool(prog.find("mtp")))
    if d.teacher_logits:
        for name, needs in (("cos", "hidden states"), ("mtp", "MTP-head logits")):
            if name in terms:
                raise PassError(f"distill: teacher_logits= stores only the teacher's next-token top-k, and the {name} "
                                f"term needs its {needs}; set {name}=0 (or leave teacher_logits unset)")
    shard = "fsdp" if d.shard == "fsdp" else "ddp"  # auto: DDP (the built-in and pruned children fit one device)
    if shard == "fsdp":
        _fsdp_available()
    rank, world = distributed()
    if d.batch % world:
        raise PassError(f"distill: batch={d.batch} must divide evenly over the {world} processes")
    per_rank = d.batch // world
    if d.accumulate > per_rank:
        raise PassError(f"distill: accumulate={d.accumulate} micro-batches need a row each, and batch={d.batch} over "
                        f"{world} process(es) gives {per_rank} rows per process; lower accumulate or raise batch")
    if state_dir is not None:
        other = {"ddp": state_dir / "distill_state.dcp", "fsdp": state_dir / "distill_state.pt"}[shard]
        if other.exists():
            raise PassError(f"distill: {state_dir} holds a {'ddp' if shard == 'fsdp' else 'fsdp'} run's checkpoint "
                            f"({other.name}); resume it with shard={'ddp' if shard == 'fsdp' else 'fsdp'}, or use a "
                            "new state directory")
    check_shared(prog, teacher_prog)
    source = _lookup(DATA, d.source, "data source", "source")(d, tokenizer_of(prog))
    schedule = _lookup(OPTIMIZERS, d.optimizer, "optimizer", "optimizer")(d)
    users = [_lookup(CALLBACKS, c, "callback", "callbacks")(d) for c in d.callbacks]

    teacher_hash = program_hash(teacher_prog)
    store = None
    if d.teacher_logits:  # before the student is built: the streamed teacher has the memory to itself
        store = TeacherStore.prepare(Path(d.teacher_logits), teacher_prog, d, source, compute, rank, world,
                                     teacher_hash)
    torch.manual_seed(d.seed)
    mesh = None
    if shard == "fsdp" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(compute.device.type, (world,))
    # the training forward may use TF32 for its float32 matmuls on CUDA; the teacher computes exactly
    trains = replace(compute, tf32=True)
    student = _build(prog, trains, mesh, train=True, checkpointing=d.checkpointing, params=d.params,
                     offload=d.offload)
    teacher = None if store else _build(teacher_prog, compute, mesh, train=False, checkpointing=False,
                                        teacher_dtype=d.teacher_dtype)
    head = [n.path for n in prog.nodes if n.op.kind == "mtp"]
    if d.head_only:
        if not head:
            raise PassError("distill: head_only=true trains the MTP head, and this model has none")
        for name, p in student.named_parameters():  # the head's own tensors; embedding and LM head stay
            p.requires_grad_(name.startswith(head[0] + "."))
    net, no_sync = student, None
    if shard == "ddp" and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [compute.device.index] if compute.device.type == "cuda" else None
        net = DistributedDataParallel(student, device_ids=ids, find_unused_parameters=True)  # unrouted experts
        no_sync = net.no_sync  # micro-batches before the last: one all-reduce per step
    # (FSDP reduce-scatters every micro-batch's gradients: accumulating them unsharded would undo the sharding)
    s_seen, s_undo = _capture(student)
    t_seen, t_undo = _capture(teacher) if teacher is not None else ([], lambda: None)
    gen = torch.Generator().manual_seed(d.seed)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    micro = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(per_rank).tensor_split(d.accumulate)]
    current: dict = {}

    def step_loss(step: int, k: int = 0):
        if k == 0:  # every process draws the same global batch and keeps its slice
            ids = source.sample(gen)
            current["ids"] = ids[rows].to(compute.device)
            if store is not None:
                v, ix = store.step(step, ids)
                current["topk"] = (v[rows].to(compute.device), ix[rows].to(compute.device))
        lo, hi = micro[k]
        ids = current["ids"][lo:hi]
        x = ids[:, :-1]
        if store is None:
            with torch.no_grad():
                t_out, topk = _outputs(teacher, t_seen, x, compute), None
        else:
            t_out, topk = Outputs(None, None, []), tuple(t[lo:hi] for t in current["topk"])
        b = Batch(ids, _outputs(net, s_seen, x, trains), t_out, d.temperature, topk)
        parts = {name: LOSSES[name](b) for name in terms}
        share = (hi - lo) / per_rank  # the micro-batch's part of the step's mean: the shares sum to 1
        loss = sum(w * parts[n] for n, w in terms.items())
        if d.accumulate > 1:
            loss = loss * share
        return loss, {n: v.item() * share for n, v in parts.items()}

    # a head-only run moves nothing the trunk KL sees: it keeps the weights of least loss of its own head terms
    metric = "mtp_loss" if d.head_only else "kl"
    mtp_weights = {HEAD_METRICS[n]: w for n, w in terms.items() if n in HEAD_METRICS}
    if d.head_only and not mtp_weights:  # only registered terms: the head against its own trunk
        mtp_weights = {"mtp_self_kl": 1.0}
    stored_eval = None
    if store is not None:
        *stored_eval, teacher_bpb = store.held_out()
    ev = Evaluator(student, teacher, source.held_out, d.eval_every, metric, users, stored_eval, mtp_weights,
                   best=d.best, state_dir=state_dir)
    identity = {**d.options(), "callbacks": list(d.callbacks), "student": program_hash(prog),
                "teacher": teacher_hash}  # not the process count: the global batch is the same
    identity["teacher_logits"] = bool(d.teacher_logits)  # what it holds is checked by its meta.json, not where
    if not d.teacher_logits:
        identity.pop("topk")
    if not d.mtp_self:  # added later: a run without it resumes from a state written before
        identity.pop("mtp_self")
    # none of these changes what is trained (the same global batch, the same numbers): a run may resume
    # elsewhere, on another number of devices, with more micro-batches or recomputed activations
    for option in ("eval_windows", "device", "shard", "accumulate", "checkpointing"):
        identity.pop(option, None)
    if state_dir is None:
        checkpoint = None
    elif shard == "fsdp":
        checkpoint = ShardedCheckpoint(state_dir / "distill_state.dcp")
    else:
        checkpoint = FileCheckpoint(state_dir / "distill_state.pt", write=rank == 0)
    with warnings.catch_warnings():
        # FSDP2 warns of blocks returning views (their decode states): nothing here changes them in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        before = {**ev.measure(), "bits_per_byte": metrics.bits_per_byte(student, source.held_out,
                                                                          token_bytes=source.token_bytes)}
        _reshard(student)
        ev.keep({"step": 0, **before})  # the starting point competes too: distillation must earn its keep
        try:
            with trains.matmul_precision():  # the backward's float32 matmuls too
                run = fit(student, step_loss, schedule, rng=gen, every=d.checkpoint_every,
                          identity=resumable(identity, d),
                          checkpoint=checkpoint, desc="distill", progress=progress if rank == 0 else False,
                          callbacks=[ev],
                          micro=d.accumulate, no_sync=no_sync, zero_unused=shard == "fsdp" and world == 1,
                          scaler=compute.grad_scaler(sharded=mesh is not None))
        finally:
            s_undo(), t_undo()
        after, kept = ev.measure(), run.step
        if d.keep_best and ev.best is not None and ev.best[metric] < after[metric]:
            ev.restore_best()  # from host memory or the state directory
            after, kept = ev.measure(), ev.best["step"]
        for name, t in full_state(student):  # whole tensors on every process: later passes run on each
            prog.weights.set(name, t.detach().clone().to("cpu", prog.weights.dtype(name)))
            prog.weights.spill_over(compute.budget // 4)  # past the budget, to scratch files as they come
        after["bits_per_byte"] = metrics.bits_per_byte(student, source.held_out, token_bytes=source.token_bytes)
        if teacher is not None:
            teacher_bpb = metrics.bits_per_byte(teacher, source.held_out, token_bytes=source.token_bytes)
        _reshard(student, teacher)
    return {"steps": run.step, "resumed_from": run.resumed_from, "stopped": run.stopped, "terms": terms,
            "selected_on": metric, "mtp_weights": mtp_weights if d.head_only else {}, "kept": kept,
            "before": before, "after": after, "teacher_bits_per_byte": teacher_bpb, "shard": shard,
            "evals": ev.evals, "best": ev.best, "log": run.log, "seconds": round(run.seconds, 2)}
