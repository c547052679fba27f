"""Progress in logs: where no bar is drawn (a scheduler's output file, --json), each long stage says how far it
got now and then, so a run watched in its log is seen to move. Times come from a fake clock, never the
machine's."""
from __future__ import annotations

import io
import re
import sys


from puzzlekit import eta
from puzzlekit.eta import LINES, Remaining

LINE = re.compile(r"^(?P<stage>[\w ()]+): (?P<k>\d+) of (?P<n>\d+) (?P<unit>\w+)s"
                  r"(?: in (?P<took>[\d.]+ (?:s|min|h))(?:; about [\d.]+ (?:s|min|h) left)?"
                  r"|, [\d.]+ (?:s|min|h) so far; about [\d.]+ (?:s|min|h) left)$")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(total: int, seconds_per_unit: float, progress=LINES) -> tuple[list[str], list[float]]:
    """The lines a stage of `total` units of `seconds_per_unit` each says, and when each was said."""
    clock, out, said = Clock(), io.StringIO(), []
    left = Remaining("library", total, progress=progress, stream=out, clock=clock)
    for _ in range(total):
        clock.now += seconds_per_unit
        before = out.getvalue().count("\n")
        left.done()
        if out.getvalue().count("\n") > before:
            said.append(clock.now)
    return out.getvalue().splitlines(), said


def test_the_first_unit_then_every_tenth_of_the_units_then_the_end():
    lines, said = _run(100, 5.0)  # a tenth (10 units) takes 50 s: above the 30 s floor, below 3 minutes
    assert lines[0] == "library: 1 of 100 layers in 5 s; about 8 min left"
    assert lines[1] == "library: 11 of 100 layers, 55 s so far; about 7 min left"
    assert lines[-1] == "library: 100 of 100 layers in 8 min"
    assert [int(ln.split()[1]) for ln in lines] == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    assert all(LINE.match(ln) for ln in lines), lines


def test_slow_units_are_said_every_three_minutes_at_most_and_fast_ones_every_30_s_at_least():
    _, slow = _run(100, 100.0)  # a tenth takes 17 min: a line every 3 minutes (the unit after they pass)
    gaps = [b - a for a, b in zip(slow, slow[1:])]
    assert slow[0] == 100.0 and max(gaps) <= eta.MOST + 100.0 and min(gaps[:-1]) >= eta.MOST
    lines, fast = _run(1000, 0.1)  # a tenth takes 10 s: never two lines within 30 s
    gaps = [b - a for a, b in zip(fast, fast[1:])]
    assert min(gaps[:-1]) >= eta.LEAST and len(lines) == 2 + 3  # first, at 30 s, 60 s, 90 s, and the end
    assert lines[-1] == "library: 1000 of 1000 layers in 2 min"


def test_silent_when_not_asked_or_for_a_single_unit():
    assert _run(50, 60.0, progress=False)[0] == []
    assert _run(1, 600.0)[0] == []  # the pass's own start and end lines say it


def test_with_a_bar_on_a_terminal_only_the_estimate_after_the_first_unit(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert eta.bars(True) and not eta.bars(LINES) and not eta.bars(False)
    lines, _ = _run(100, 60.0, progress=True)  # the bar shows the rest: no second line beside it
    assert lines == ["library: 1 of 100 layers in 60 s; about 1.6 h left"]
    assert len(_run(100, 60.0, progress=LINES)[0]) > 10  # lines asked for: lines, terminal or not


def test_a_pipeline_reports_lines_where_its_bars_are_off():
    from puzzlekit.passes import AnalysisManager, Instrumentation
    from puzzlekit.passes.manager import reporting

    am = AnalysisManager(None)
    for ins, how in ((Instrumentation(progress=True), True), (Instrumentation(), LINES),
                     (Instrumentation(lines=False), False)):
        am.instrument = ins
        assert reporting(am) == how


#: one variant a layer: the lines are said per layer, however many variants each has
ONE_VARIANT_GRID = """
[mamba2]
heads = [0.5]
[moe]
top_k = [0.5]
[attention]
q_heads = [0.5]
[mlp]
d_ff = [0.5]
"""


def test_a_library_built_with_stderr_in_a_file_writes_its_progress_lines(tmp_path, monkeypatch):
    """The `library` command, run in this process with sys.stderr a file (not a terminal: no bars, lines), on a
    one-variant grid and the least data that still trains and scores every layer."""
    from puzzlekit.tools.cli import main

    grid, log = tmp_path / "grid.toml", tmp_path / "log"
    grid.write_text(ONE_VARIANT_GRID)
    with log.open("w") as f, monkeypatch.context() as mp:
        mp.setattr(sys, "stderr", f)
        code = main(["library", "-o", str(tmp_path / "lib"), "--grid", str(grid), "--calib-windows", "2",
                     "--score-windows", "1", "--seq", "32", "--bld-tokens", "512", "--threads", "1"])
    text = log.read_text()
    assert code == 0, text
    assert "\r" not in text  # no bar piled up in the file
    lines = [m.groupdict() for m in map(LINE.match, text.splitlines()) if m]
    for stage in ("library sweep (train)", "library sweep (valid)", "library"):
        said = [ln for ln in lines if ln["stage"] == stage]
        assert said[0]["k"] == "1" and said[0]["unit"] == "layer", text  # the first unit, with an estimate
        assert said[-1]["k"] == said[-1]["n"] == "12" and said[-1]["took"], text  # and the end
