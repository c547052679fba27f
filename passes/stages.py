"""Resumable pipelines: after every pass (nested ones included, in execution order) the program, the named
snapshots and the passes' reports are saved under a stage directory; a rerun on the same model skips the
passes that finished and continues from the last saved state, provided the pipeline up to there is the same
(later passes may change, e.g. a tolerance).

    ROOT/run.json            the hash of the model this directory belongs to
    ROOT/NNNN/               the program after the NNNN-th pass (a checkpoint) and stage.json (written last:
                             the passes run so far, the snapshots, the reports)
    ROOT/snapshots/NAME-K/   each snapshot, saved once

Only the latest stage and the one a run resumed from are kept (lazily loaded weights may still point there).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..ir import Program, load, save
from ..outputs import write_json
from .core import PassError, Preserved

#: what passes leave in Program.meta that a checkpoint's config does not hold
CARRIED_META = ("plan",)


class StageCheckpoints:
    def __init__(self, root, model_hash: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        run = self.root / "run.json"
        if run.exists():
            old = json.loads(run.read_text())
            if old != {"model": model_hash}:
                raise PassError(f"{self.root} holds the stages of a run on another model (or other data, or "
                                "another tokenizer); rerun with the same ones to resume, or use another output directory")
        else:
            write_json(run, {"model": model_hash})
        done = [int(d.name) for d in self.root.iterdir() if d.name.isdigit() and (d / "stage.json").exists()]
        self.resume_at = max(done, default=0)
        self.count = 0
        self.ran: list[str] = []
        self.source: Path | None = None  # the stage this run resumed from
        self.saved: dict[int, str] = {}  # id(snapshot program) -> its directory name

    def _dir(self, i: int) -> Path:
        return self.root / f"{i:04d}"

    def skip(self, label: str, prog: Program, am) -> bool:
        """Called before each pass: True when it finished in an earlier run (the state after it is restored
        when it is the last that did)."""
        self.count += 1
        self.ran.append(label)
        if self.count > self.resume_at:
            return False
        if self.count == self.resume_at:
            self._restore(label, prog, am)
        return True

    def _restore(self, label: str, prog: Program, am) -> None:
        d = self._dir(self.count)
        stage = json.loads((d / "stage.json").read_text())
        if stage["ran"] != self.ran:
            i = next(i for i, (a, b) in enumerate(zip(stage["ran"] + [""], self.ran)) if a != b)
            raise PassError(f"cannot resume from {d}: pass {i + 1} of the pipeline was {stage['ran'][i]!r} there and "
                            f"is {self.ran[i]!r} now; rerun the same pipeline, or remove {self.root} to start over")
        prog.__dict__.update(load(d).__dict__)  # in place: the caller holds this object
        am.snapshots = {}
        for name, sub in stage["snapshots"].items():
            snap = load(self.root / "snapshots" / sub)
            am.snapshots[name] = snap
            self.saved[id(snap)] = sub
        am.reports = stage["reports"]
        prog.meta.update(stage["meta"])
        am.invalidate(Preserved.none())
        self.source = d

    def save(self, label: str, prog: Program, am) -> None:
        """Called after each pass that ran: the state after it, then its marker."""
        snaps = {}
        for name, snap in am.snapshots.items():
            if id(snap) not in self.saved:
                sub = f"{name}-{self.count:04d}"
                target = self.root / "snapshots" / sub
                if target.exists():
                    shutil.rmtree(target)
                save(snap, target, extended=True)
                self.saved[id(snap)] = sub
            snaps[name] = self.saved[id(snap)]
        d = self._dir(self.count)
        if d.exists():
            shutil.rmtree(d)
        save(prog, d, extended=True)
        write_json(d / "stage.json", {"ran": self.ran, "snapshots": snaps, "reports": am.reports,
                                       "meta": {k: prog.meta[k] for k in CARRIED_META if k in prog.meta}})
        for old in self.root.iterdir():
            if old.name.isdigit() and int(old.name) < self.count and old != self.source:
                shutil.rmtree(old)
