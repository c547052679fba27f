"""`auto`: the cheapest settings under which a stage fits the hardware it runs on, chosen from the estimate.

Each distillation not given the option explicitly climbs a ladder of rungs, cheapest first, until its stage fits;
each rung keeps the ones below it. Time-only savings come before those that cost quality (measured in
docs/benchmarks.md), and host offload, the slowest, last but one:

  shard=fsdp (more than one process) -> checkpointing=true -> one row per micro-batch (accumulate) ->
  params=bf16 with optimizer=adamw-bf16 (a bfloat16 forward only) -> teacher_dtype=fp8 -> offload=true (fsdp) ->
  best=disk (a state directory)

A stage that fits as given is left alone; one that fits on no rung keeps every rung, and the refusal names what
else would help. An option the pipeline sets (`Pass.given`) is never changed.
"""
from __future__ import annotations

import dataclasses
import math

#: the rungs: (name, the options it sets, whether it applies to a pass on this hardware)
RUNGS = (
    ("fsdp", lambda p, hw: {"shard": "fsdp"}, lambda p, hw: hw.processes > 1 and p.shard == "auto"),
    ("checkpointing", lambda p, hw: {"checkpointing": True}, lambda p, hw: True),
    ("one row per micro-batch", lambda p, hw: {"accumulate": max(1, math.ceil(p.batch / hw.processes))},
     lambda p, hw: True),
    ("bf16 state", lambda p, hw: {"params": "bf16", "optimizer": "adamw-bf16"},
     lambda p, hw: (hw.kind == "gpu" and p.dtype in ("", "auto", "bfloat16")) or p.dtype == "bfloat16"),
    ("fp8 teacher", lambda p, hw: {"teacher_dtype": "fp8"}, lambda p, hw: not p.teacher_logits),
    ("offload", lambda p, hw: {"offload": True}, lambda p, hw: p.shard == "fsdp"),
    ("best on disk", lambda p, hw: {"best": "disk"}, lambda p, hw: p.keep_best and bool(p.state)),
)
#: the passes a ladder applies to
CHOSEN = ("distill",)


def given(p) -> frozenset:
    """The options a pipeline's text set on pass `p` (none for a pass built in code)."""
    return getattr(p, "given", frozenset())


def climb(p, fits, hw):
    """(the pass with the first rungs under which `fits(pass)` holds, {option: value} they set). A rung that would
    change an option in `given(p)` is skipped whole (its options go together), as is one the pass refuses."""
    from ..passes.core import PassError

    if fits(p):
        return p, {}
    chosen = {}
    for _, options, applies in RUNGS:
        opts = options(p, hw) if applies(p, hw) else {}
        if any(k in given(p) for k in opts):
            continue
        new = {k: v for k, v in opts.items() if getattr(p, k) != v}
        if not new:
            continue
        try:
            p = _with(p, new)
        except PassError:  # a combination the pass cannot run (e.g. with an option of its own)
            continue
        chosen |= new
        if fits(p):
            break
    return p, chosen


def _with(p, options: dict):
    q = dataclasses.replace(p, **options)
    for attr in ("given", "body"):
        if hasattr(p, attr):
            setattr(q, attr, getattr(p, attr))
    return q


def keyed(passes: list, chosen: list[tuple[object, dict]]) -> list[tuple[str, int, dict]]:
    """`chosen` ((pass, options) of `passes`) as (pass name, its occurrence among passes of that name, options):
    how a run's summary names them (a repeat's body counted once)."""
    seen = _occurrences(passes)
    return [(p.pass_name, seen[id(p)], opts) for p, opts in chosen]


def _flat(passes: list) -> list:
    out = []
    for p in passes:
        out.append(p)
        out += _flat(getattr(p, "body", None) or [])
    return out


def _occurrences(passes: list) -> dict:
    count, out = {}, {}
    for p in _flat(passes):
        name = getattr(p, "pass_name", "")
        out[id(p)] = count.get(name, 0)
        count[name] = out[id(p)] + 1
    return out


def describe(chosen: list[tuple[str, dict]]) -> str:
    """One line: what auto chose for which stage ("" when nothing)."""
    parts = [f"{name}: " + ", ".join(f"{k}={_text(v)}" for k, v in opts.items()) for name, opts in chosen if opts]
    return ("auto chose " + "; ".join(parts) + " (to fit; an option set in the pipeline wins)") if parts else ""


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
