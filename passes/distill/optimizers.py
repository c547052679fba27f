"""The distill pass's optimizers whose state fits a large student on one node, beside `adamw-cosine`: the
same warmup and cosine decay and the same weight-decay grouping (`training.Schedule`), another AdamW state
(`training.optimizers`). Registered when the package is imported; apart from the registries so that they
can be read on their own. Also the checks and checkpoint identity of the options that hold the state
(`params`, `offload`, `best`, `teacher_dtype`).
(`Distill` in annotations is the pass, `passes.distill.Distill`: not imported, since the package imports
this module.)"""
from __future__ import annotations

from ...training import Schedule
from ..core import PassError
from .registries import register_optimizer

PARAMS = ("fp32", "bf16")
BEST = ("host", "disk")
TEACHER_DTYPES = ("auto", "fp8")
#: optimizers that update bfloat16 parameters without losing the small steps (stochastic rounding)
ROUNDS_STOCHASTICALLY = ("adamw-bf16", "adamw-8bit")


def _schedule(d: Distill, algorithm: str) -> Schedule:
    return Schedule(d.steps, d.lr, warmup=min(d.warmup, d.steps), weight_decay=0.0, algorithm=algorithm,
                    seed=d.seed)


@register_optimizer("adamw-bf16")
def adamw_bf16(d: Distill) -> Schedule:
    """`adamw-cosine` with bfloat16 moments; bfloat16 parameters (params=bf16) rounded stochastically."""
    return _schedule(d, "adamw-bf16")


@register_optimizer("adamw-8bit")
def adamw_8bit(d: Distill) -> Schedule:
    """`adamw-cosine` with torchao's 8-bit moments; bfloat16 parameters rounded stochastically."""
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        raise PassError("distill: optimizer=adamw-8bit is torchao's AdamW8bit, and torchao is not installed: "
                        "pip install torchao (or use optimizer=adamw-bf16)") from None
    return _schedule(d, "adamw-8bit")


def check_options(d: Distill) -> None:
    """The state options' values and combinations that cannot work, refused when the pass is made."""
    for name, allowed in (("params", PARAMS), ("best", BEST), ("teacher_dtype", TEACHER_DTYPES)):
        if getattr(d, name) not in allowed:
            raise PassError(f"pass 'distill': {name}={getattr(d, name)!r} is not one of {', '.join(allowed)}")
    if d.params == "bf16":
        if d.optimizer == "adamw-cosine":
            raise PassError("pass 'distill': params=bf16 with optimizer=adamw-cosine would round every update to "
                            "the nearest bfloat16 and lose the small ones; use optimizer=adamw-bf16 or adamw-8bit")
        if d.dtype in ("float32", "float16"):
            raise PassError(f"pass 'distill': params=bf16 holds the blocks' weights in bfloat16, which a {d.dtype} "
                            "forward cannot use; set dtype=bfloat16 (the default on CUDA) or params=fp32")
    if d.offload and d.shard != "fsdp":
        raise PassError("pass 'distill': offload=true keeps FSDP2's shards in host memory; set shard=fsdp")
    if d.teacher_dtype == "fp8" and d.teacher_logits:
        raise PassError("pass 'distill': teacher_dtype=fp8 holds the live teacher in FP8, and teacher_logits= runs "
                        "none; leave one of them unset")


def resumable(identity: dict, d: Distill) -> dict:
    """The checkpoint identity without the state options that do not change what is trained (`offload`,
    `best`: where the state waits), nor those left at their defaults (a run written before they existed
    resumes)."""
    out = {k: v for k, v in identity.items() if k not in ("offload", "best")}
    for name, default in (("params", "fp32"), ("teacher_dtype", "auto")):
        if getattr(d, name) == default:
            out.pop(name, None)
    return out
