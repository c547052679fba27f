"""`--estimate` and `--hardware` on compress, library and run: what each stage needs, printed before any weight
is read; without `--estimate`, a run whose stage cannot fit is refused here, before any work."""
from __future__ import annotations

import sys

from ..errors import UsageError
from ..estimate.hardware import Untimed  # noqa: F401  (the check before a run prices no time)


def add_estimate_arguments(parser) -> None:
    parser.add_argument("--estimate", action="store_true",
                        help="print each stage's peak memory per process, time and whether it fits, from the config "
                             "and the options alone (no weights read), and stop")
    parser.add_argument("--hardware", metavar="GPU:N",
                        help="what the run will have, for --estimate and the check before a run: h100:8, b200:16 "
                             "(N processes, one per GPU, as under torchrun) or cpu (default: the visible GPUs, or "
                             "this machine)")


def library_passes(args) -> list:
    """The `library` command's work as the pass it runs."""
    from ..passes.core import PASSES

    return [PASSES["library"](out=args.output, grid=args.grid or "", bld_tokens=args.bld_tokens,
                              bld_lr=args.bld_lr, calib_windows=args.calib_windows, score_windows=args.score_windows,
                              seq=args.seq)]


def check_before_run(args, passes: list, prog, writes: bool = True, announce: bool = False,
                     left_out: str = "", plan: bool = False, chosen: list | None = None, outputs=None) -> bool:
    """Sets on `passes` the settings `auto` chooses to fit (estimate.choose), printed with the estimate. With
    `--estimate`: prints the estimate (or its JSON) and returns True (the command stops). Otherwise refuses
    (exit 2) a run one of whose stages would not fit the memory it has, and returns False; `announce` (a long run:
    compress, library) prints the whole estimate on stderr first, once. `plan`: the stages after the search at the
    child a weightless search picks (compress); `outputs` (estimate.Outputs) its work after the child is written.
    `chosen` gets auto's choices keyed by pass (for the run's summary)."""
    from ..estimate import estimate, parse_hardware
    from ..memory import budget
    from .common import emit

    hw = parse_hardware(getattr(args, "hardware", None), getattr(args, "device", "auto"))
    # each process's budget: --max-memory, or half of its share of the host (a node's GPUs share it)
    host = budget(args.max_memory) if hw.kind == "cpu" or args.max_memory else hw.host_bytes // 2
    model = getattr(args, "model", None) or "the built-in model"
    timed = getattr(args, "estimate", False) or (announce and not args.json)
    if timed and hw.kind == "cpu":  # blocks are timed with the threads the run would take
        from ..backends.torch.device import use_threads

        use_threads(prog.param_counts()["total"], getattr(args, "threads", 0))
    run = lambda planned: estimate(passes, prog, hw, host, model, rates=None if timed else Untimed(hw),
                                   writes=writes, left_out=left_out, plan=planned, auto=True, outputs=outputs)
    # the child is planned (a weightless search: seconds) for --estimate, and for a run that does not fit as it is
    est = run(plan and getattr(args, "estimate", False))
    if plan and not getattr(args, "estimate", False) and (est.chosen or not est.fits):
        est = run(True)
    for p, options in est.chosen:  # the passes this command runs take what auto chose
        for k, v in options.items():
            setattr(p, k, v)
    if chosen is not None:  # and a later parse of the same pipeline (estimate.choose.apply)
        from ..estimate.choose import keyed

        chosen += keyed(passes, est.chosen)
    if getattr(args, "estimate", False):
        emit(args, est.as_json(), est.format())
        return True
    if timed:
        print(est.format(), end="", file=sys.stderr, flush=True)
    elif est.chosen and not getattr(args, "json", False):
        print(est.choices(), file=sys.stderr, flush=True)
    if not est.fits:
        raise UsageError(est.refusal())
    return False
