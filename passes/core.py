"""Passes, what they preserve, analyses and their cache."""
from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import PuzzlekitError
from ..ir import Program

#: facets of a Program a pass can keep valid
FACETS = frozenset({"structure", "weights"})


class PassError(PuzzlekitError):
    """A pass failed, or a pipeline cannot be built."""


@dataclass(frozen=True)
class Preserved:
    """What stays valid after a pass: program facets, plus analyses kept by name."""

    facets: frozenset = frozenset()
    analyses: frozenset = frozenset()

    @classmethod
    def all(cls) -> Preserved:
        return cls(FACETS)

    @classmethod
    def none(cls) -> Preserved:
        return cls()

    @classmethod
    def structure_only(cls) -> Preserved:
        """Weights changed (e.g. distillation), ops and shapes did not."""
        return cls(frozenset({"structure"}))

    @classmethod
    def weights_only(cls) -> Preserved:
        """Op attributes changed (e.g. top_k), every tensor is unchanged."""
        return cls(frozenset({"weights"}))

    def keep(self, *analyses: str) -> Preserved:
        """Also keep these analyses, whatever their dependencies."""
        return Preserved(self.facets, self.analyses | frozenset(analyses))

    def keeps(self, analysis: Analysis) -> bool:
        return analysis.name in self.analyses or analysis.depends <= self.facets


# -- passes ---------------------------------------------------------------------------------------------
class Pass:
    """A transform over a Program. Subclasses are dataclasses whose fields are their options."""

    pass_name: ClassVar[str] = ""
    #: a pass that takes a nested pipeline, like repeat{n=3}(a,b), gets it in `self.body`
    nested: ClassVar[bool] = False
    #: the least value of numeric options that count something, e.g. {"samples": 1}
    minimum: ClassVar[dict] = {}
    body: list

    def __post_init__(self):
        """Refuses what no option can mean, however the pass is built: NaN/inf floats, counts below `minimum`."""
        for k, v in self.options().items():
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(x, float) and not math.isfinite(x):
                    raise PassError(f"pass {self.pass_name!r}: option {k}={x} is not a finite number")
            if k in self.minimum and v < self.minimum[k]:
                raise PassError(f"pass {self.pass_name!r}: option {k}={v} must be >= {self.minimum[k]}")

    def run(self, prog: Program, am: AnalysisManager) -> Preserved:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def doc(cls) -> str:
        return (inspect.getdoc(cls) or "").split("\n")[0]


@dataclass
class ComputePass(Pass):
    """A pass that runs the model. `device` (auto, cpu, cuda, cuda:N) and `dtype` (auto, float32, bfloat16,
    float16) default to the pipeline's (`--device` / `--dtype` of run and compress)."""

    device: str = ""
    dtype: str = ""

    def compute(self, am: AnalysisManager):
        from ..backends.torch.device import resolve

        return resolve(self.device or am.device, self.dtype or am.dtype, am.max_memory)


def pipeline_data(own, am) -> list[str]:
    """A pass's text: its own `data=` option, else the pipeline's (`--data` of run and compress); empty means the
    standard library."""
    return [str(d) for d in own] or [str(d) for d in getattr(am, "data", None) or []]


PASSES: dict[str, type[Pass]] = {}


def register(name: str) -> Callable:
    """Registers a Pass subclass, or a plain function `fn(prog, am, **options) -> Preserved`, under `name`."""

    def wrap(obj):
        old = PASSES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (obj.__module__, obj.__qualname__):
            raise PassError(f"a pass named {name!r} is already registered ({PASSES[name].__module__})")
        if isinstance(obj, type):
            cls = obj if dataclasses.is_dataclass(obj) and "__dataclass_fields__" in obj.__dict__ else dataclass(obj)
        else:
            cls = _function_pass(obj)
        cls.pass_name = name
        PASSES[name] = cls
        return obj if not isinstance(obj, type) else cls

    return wrap


def _function_pass(fn: Callable) -> type[Pass]:
    params = list(inspect.signature(fn).parameters.values())[2:]
    hints = inspect.get_annotations(fn, eval_str=True)
    fields = []
    for p in params:
        if p.default is inspect.Parameter.empty:
            raise PassError(f"pass function {fn.__name__}: option {p.name!r} needs a default value")
        fields.append((p.name, hints.get(p.name, type(p.default)), dataclasses.field(default=p.default)))

    def run(self, prog, am):
        return fn(prog, am, **self.options())

    cls = dataclasses.make_dataclass(fn.__name__, fields, bases=(Pass,), namespace={"run": run, "__doc__": fn.__doc__})
    cls.__module__ = fn.__module__
    return cls


# -- analyses ---------------------------------------------------------------------------------------------
class Analysis:
    """A lazily computed fact about a Program. `depends` names the facets whose change invalidates it."""

    name: ClassVar[str] = ""
    depends: ClassVar[frozenset] = FACETS

    def compute(self, prog: Program, am: AnalysisManager, **options):
        raise NotImplementedError


ANALYSES: dict[str, type[Analysis]] = {}


def analysis(name: str, depends=("structure", "weights")) -> Callable:
    """Registers `fn(prog, am, **options)` as an analysis."""

    def wrap(fn):
        cls = type(fn.__name__, (Analysis,), {"name": name, "depends": frozenset(depends),
                                              "compute": lambda self, p, am, **o: fn(p, am, **o),
                                              "__doc__": fn.__doc__})
        ANALYSES[name] = cls
        return fn

    return wrap


class AnalysisManager:
    """Computes analyses on demand, caches them per options, forgets what a pass did not preserve.

    It also keeps named snapshots of the program (e.g. the teacher) for later passes.
    """

    def __init__(self, prog: Program):
        self.prog = prog
        self._cache: dict[tuple, Any] = {}
        self.snapshots: dict[str, Program] = {}
        self.computed: list[str] = []  # every computation, in order (for instrumentation and tests)
        self.reports: dict[str, dict] = {}  # what passes measured (e.g. quantize's KL), by pass name
        self.manager = None  # the PassManager running (nested pipelines run through it)
        self.instrument = None
        self.round = (1, 1)  # (i, n) inside the i-th of n iterations of repeat{n=...}
        self.device, self.dtype = "auto", "auto"  # the pipeline's, for passes that compute (ComputePass)
        self.max_memory = ""  # the pipeline's memory budget (puzzlekit.memory); "" : the default

    def get(self, name: str, **options):
        if name not in ANALYSES:
            raise PassError(f"unknown analysis {name!r}; known: {sorted(ANALYSES)}")
        key = (name, tuple(sorted(options.items())))
        if key not in self._cache:
            self._cache[key] = ANALYSES[name]().compute(self.prog, self, **options)
            self.computed.append(name)
        return self._cache[key]

    def invalidate(self, preserved: Preserved) -> None:
        self._cache = {k: v for k, v in self._cache.items() if preserved.keeps(ANALYSES[k[0]])}
