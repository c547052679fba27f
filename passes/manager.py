"""The PassManager: runs a pipeline with verification, timing, IR printing and progress reporting."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ..eta import LINES, Remaining, bars
from ..errors import PuzzlekitError
from ..ir import Program, print_program, verify
from .core import AnalysisManager, Pass, PassError, Preserved
from .pipeline import parse_pipeline, print_pipeline


@dataclass
class Instrumentation:
    """What the manager does around each pass."""

    verify_each: bool = False
    print_ir_after: bool = False
    progress: bool = False  # show progress bars for long passes on a terminal (see `progress`)
    lines: bool = True  # where no bar is drawn (a log file, --json), a progress line on stderr now and then
    log: bool = False  # a line on stderr as each pass starts and ends (with its time), piped or not
    out: object = None  # where IR dumps go (default: stderr)
    stages: object = None  # a stages.StageCheckpoints: save after each pass, skip what an earlier run finished
    timings: list[tuple[str, float]] = field(default_factory=list)


class PassManager:
    """Runs passes in order over one Program, sharing an AnalysisManager between them."""

    def __init__(self, passes: list[Pass] | str, instrument: Instrumentation | None = None, device: str = "auto",
                 dtype: str = "auto", max_memory: str = "", data: list[str] | None = None):
        """`device` and `dtype`: where passes that compute run, unless a pass's own options say otherwise;
        `max_memory`: their memory budget (puzzlekit.memory); `data`: the text of passes whose own `data=` is
        empty (default: the standard library)."""
        self.passes = parse_pipeline(passes) if isinstance(passes, str) else list(passes)
        self.instrument = instrument or Instrumentation()
        self.device, self.dtype, self.max_memory = device, dtype, max_memory
        self.data = list(data or [])

    @property
    def pipeline(self) -> str:
        return print_pipeline(self.passes)

    def run(self, prog: Program, am: AnalysisManager | None = None) -> AnalysisManager:
        am = am or AnalysisManager(prog)
        am.instrument, am.manager = self.instrument, self
        am.device, am.dtype, am.max_memory, am.data = self.device, self.dtype, self.max_memory, self.data
        self._run_list(self.passes, prog, am, [])
        return am

    def _run_list(self, passes: list[Pass], prog: Program, am: AnalysisManager, ran: list[str]) -> None:
        ins = self.instrument
        for p in passes:
            label = print_pipeline([p])
            if ins.stages is not None and not p.nested and ins.stages.skip(label, prog, am):
                ran.append(label)
                _log(ins, p.pass_name, "done in an earlier run: skipped")
                continue
            _log(ins, p.pass_name, "started")
            start = time.perf_counter()
            heads = len(prog.find("mtp"))
            try:
                preserved = p.run(prog, am)
                if not isinstance(preserved, Preserved):
                    raise PassError(f"returned {type(preserved).__name__}, not Preserved")
                if len(prog.find("mtp")) < heads and not getattr(p, "drop_mtp", False):
                    raise PassError("it removed the MTP head; a pass may drop the head only when asked "
                                    "explicitly (its option drop_mtp=true)")
                am.invalidate(preserved)
                if ins.verify_each:
                    verify(prog)
            except PuzzlekitError as e:
                raise PassError(f"pass {label} failed: {e}\n  passes run before it: {', '.join(ran) or 'none'}") from e
            except (Exception, SystemExit) as e:  # a bug in a pass: still say which pass, keep the traceback chained
                what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
                raise PassError(f"pass {label} failed: {what}\n"
                                f"  passes run before it: {', '.join(ran) or 'none'}") from e
            ins.timings.append((label, time.perf_counter() - start))
            _log(ins, p.pass_name, f"done in {ins.timings[-1][1]:.1f} s")
            ran.append(label)
            if ins.stages is not None and not p.nested:
                ins.stages.save(label, prog, am)
            if ins.print_ir_after:
                print(f"// IR after {label}\n{print_program(prog)}", file=ins.out or sys.stderr)

    def run_nested(self, body: list[Pass], prog: Program, am: AnalysisManager) -> None:
        self._run_list(body, prog, am, [])


def _log(ins: Instrumentation, name: str, what: str) -> None:
    if ins.log:
        print(f"{name}: {what}", file=ins.out or sys.stderr, flush=True)


def reporting(am: AnalysisManager) -> bool | str:
    """How a pass shows a long loop's progress (eta.Remaining's `progress`): True (a bar on a terminal, lines
    elsewhere), eta.LINES (lines only: the bars are off) or False."""
    ins = getattr(am, "instrument", None)
    if ins is None:
        return False
    return True if ins.progress else LINES if ins.lines else False


def progress(iterable, am: AnalysisManager, desc: str, total: int | None = None, unit: str = "layer"):
    """Yields the items of a long loop of a pass; as each is done, a bar or a line says so (`reporting`)."""
    how = reporting(am)
    total = total if total is not None else len(iterable) if hasattr(iterable, "__len__") else 0
    left = Remaining(desc, total, unit, how)
    for item in tqdm(iterable, desc=desc, total=total or None, disable=not bars(how), leave=False):
        yield item
        left.done()
