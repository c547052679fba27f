"""Built-in passes and analyses."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from ..ir import Program, print_program, verify
from ..ir.ops import Noop
from .core import AnalysisManager, Pass, PassError, Preserved, analysis, register


@analysis("param-counts", depends=("structure",))
def param_counts(prog: Program, am: AnalysisManager) -> dict:
    """Total and active parameters, per block kind (see Program.param_counts)."""
    return prog.param_counts()


@analysis("routing")
def routing_stats(prog: Program, am: AnalysisManager, samples: int = 16, seq: int = 128) -> dict:
    """Per MoE node (trunk and MTP head): how often each expert is chosen per token (sums to top_k),
    measured on held-out text."""
    import torch

    from ..backends.torch.stream import StreamedProgram
    from ..text.data import calibration_windows

    if samples < 1 or seq < 1:
        raise PassError(f"routing analysis: samples={samples} and seq={seq} must both be >= 1")
    counts: dict[str, torch.Tensor] = {}

    def attach(node, module):  # one layer at a time (backends.torch.stream): the model need not fit in memory
        undo = []
        for sub, m in module.named_modules():
            if hasattr(m, "route"):
                def hook(mod, args, out, path=f"{node.path}.{sub}"):
                    chosen = out[0]
                    c = torch.bincount(chosen.reshape(-1), minlength=mod.spec.experts).float() / chosen.shape[0]
                    counts[path] = counts.get(path, 0) + c
                undo.append(_wrap_route(m, hook))
        return (lambda: [u() for u in undo]) if undo else None

    windows = calibration_windows(list(getattr(am, "data", None) or []), samples, seq, prog)
    for _ in StreamedProgram(prog).outputs(windows, 4, attach=attach):
        pass
    batches = -(-len(windows) // 4)
    return {p.removesuffix(".mixer"): (c / batches).tolist() for p, c in counts.items()}


def _wrap_route(mixer, hook):
    """Calls `hook(mixer, args, result)` after every routing decision; returns the undo function."""
    original = mixer.route

    def route(*args):
        out = original(*args)
        hook(mixer, args, out)
        return out

    mixer.route = route
    return lambda: mixer.__dict__.pop("route", None)


@analysis("cost")  # weights matter too: measured routing and quantized weights
def cost_analysis(prog: Program, am: AnalysisManager, target: str = "h100", scenario: str = "decode-heavy",
                  recipe: str = "", measured_routing: bool = False) -> dict:
    """The cost model's report (backends/cost/) for a target and a named scenario, in its best layout the serving
    engines split the model over (as `puzzlekit cost` and the search price); with measured_routing, MoE decode
    reads the experts the `routing` analysis saw being chosen."""
    from ..backends.cost import best_layout, get_scenario

    routing = {k: v for k, v in am.get("routing").items() if not k.startswith("mtp")} if measured_routing else None
    return best_layout(prog, target, get_scenario(scenario, recipe=recipe or None), routing=routing,
                       engines=True)[1].to_json()


@register("verify")
class Verify(Pass):
    """Check every invariant of the program; fail with the list of problems."""

    check_finite: bool = False

    def run(self, prog, am):
        verify(prog, check_finite=self.check_finite)
        return Preserved.all()


@register("print-ir")
class PrintIR(Pass):
    """Print the program's text form (to stderr)."""

    def run(self, prog, am):
        import sys

        print(print_program(prog), file=sys.stderr)
        return Preserved.all()


@register("snapshot")
class Snapshot(Pass):
    """Keep a frozen copy of the program under `name` (e.g. the teacher) for later passes."""

    name: str = "teacher"

    def run(self, prog, am):
        am.snapshots[self.name] = prog.copy()
        return Preserved.all()


def _layers(prog: Program, layers: list[int], kind: str | None, who: str) -> list:
    """The chosen blocks (an empty list means every block of `kind`), checked before anything changes."""
    blocks = prog.blocks()
    layers = sorted(set(layers))
    bad = [i for i in layers if not 0 <= i < len(blocks)]
    if bad:
        raise PassError(f"{who}: layers {bad} out of range; the program has {len(blocks)} layers (0..{len(blocks) - 1})")
    chosen = [blocks[i] for i in layers] if layers else prog.blocks(kind)
    if kind:
        wrong = [n.path for n in chosen if n.op.kind != kind]
        if wrong:
            raise PassError(f"{who}: {wrong} are not {kind} blocks")
    return chosen


@register("set-topk")
class SetTopK(Pass):
    """Route every token of the chosen MoE layers (default: all) to `k` experts."""

    k: int
    layers: list[int] = field(default_factory=list)
    minimum: ClassVar[dict] = {"k": 1}

    def run(self, prog, am):
        changed = False
        chosen = _layers(prog, self.layers, "moe", "set-topk")
        for n in chosen:
            if not 1 <= self.k <= n.op.experts:
                raise PassError(f"set-topk: k={self.k} must be in 1..{n.op.experts} (experts of {n.path})")
        for n in chosen:
            if n.op.top_k != self.k:
                prog.rewrite(n, op=n.op.replace(top_k=self.k))
                changed = True
        return Preserved.weights_only() if changed else Preserved.all()


@register("drop-blocks")
class DropBlocks(Pass):
    """Replace the chosen layers by `noop` blocks (their weights are dropped)."""

    layers: list[int]

    def run(self, prog, am):
        changed = [n for n in _layers(prog, self.layers, None, "drop-blocks") if n.op.kind != "noop"] \
            if self.layers else []
        for n in changed:
            prog.rewrite(n, op=Noop(n.op.hidden))
        return Preserved.none() if changed else Preserved.all()


@register("repeat")
class Repeat(Pass):
    """Run the nested pipeline `n` times: repeat{n=3}(a,b)."""

    nested = True
    minimum: ClassVar[dict] = {"n": 1}
    n: int = 1
    body: list = field(default_factory=list)

    def run(self, prog, am):
        from .manager import PassManager

        manager = am.manager or PassManager(self.body)
        outer = getattr(am, "round", (1, 1))
        try:
            for i in range(self.n):
                am.round = (i + 1, self.n)  # passes that move toward a target in steps read it (e.g. puzzle)
                manager.run_nested(self.body, prog, am)
        finally:
            am.round = outer
        return Preserved.all()  # the nested passes already invalidated what they changed
