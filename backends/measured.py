"""The `cpu` cost provider: op times measured on this machine, taken together and re-checked.

A search sums per-op times and compares the sums, so the times must be comparable. Every op a pricing
needs is timed in one round-robin (op A, op B, ..., then A, B, ... again; the mean of each), so a change
in the machine's load moves all of them alike. Times are cached on disk under the conditions that set them
(CPU model, cores, threads, torch version, default dtype); a cache written under other conditions is not
read. A matching cache is still re-checked: the first time a provider uses it, a few of its entries are
timed again, and if one is off by more than `tolerance` the whole cache is dropped and timed afresh.
`measure_model` times the whole model the same way, so the sum of the parts can be checked against it.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ..errors import PuzzlekitError, UsageError
from ..outputs import cache_dir
from .torch.device import CPU, Compute

FIX = "price it on an analytic target (--target h100, or a target file describing this CPU) or a shorter one"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def conditions(compute: Compute = CPU) -> dict:
    """What a timing depends on besides the op and its shapes."""
    out = {"cpu": _cpu_model(), "machine": platform.machine(), "cores": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(torch.get_default_dtype())}
    if compute != CPU:
        gpu = torch.cuda.get_device_name(compute.device) if compute.device.type == "cuda" else ""
        out |= {"device": str(compute.device), "gpu": gpu, "compute_dtype": str(compute.dtype)}
    return out


#: a cost table every MeasuredProvider of the process uses, as it is (see MeasuredProvider)
COST_TABLE_ENV = "PUZZLEKIT_COST_TABLE"


class CostTableError(UsageError):
    """A cost table to be used as it is (compress --cost-table, a run's own) that is not one: read before any
    work, since a table silently dropped would be timed anew for minutes and give another child."""


def read_cost_table(path, fix: str = "give a run's OUT/cost-table.json, or drop --cost-table to time the ops "
                                     "on this machine") -> dict:
    """The times of the cost table at `path`, checked: JSON in the form a provider writes ({"conditions": {...},
    "times": {op key: seconds}}), every key an op's and every time a finite number >= 0, timed on a CPU (the
    `cpu` target's device; the machine may be another). Raises CostTableError naming the file, what is wrong and
    `fix`."""
    def bad(what: str):
        return CostTableError(f"cost table {path}: {what}; {fix}")

    try:
        raw = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # not JSON (UnicodeDecodeError is a ValueError too)
        raise bad(f"not a cost table: not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("conditions"), dict) or \
            not isinstance(raw.get("times"), dict):
        keys = ", ".join(list(raw)[:6]) if isinstance(raw, dict) else type(raw).__name__
        raise bad("not a cost table (op timings: an object of 'conditions' and 'times'; this holds "
                  f"{keys or 'nothing'})")
    device = raw["conditions"].get("device", "cpu")
    if device != "cpu":
        gpu = raw["conditions"].get("gpu")
        raise bad(f"timed on {device}{f' ({gpu})' if gpu else ''}, and the cpu target is priced from CPU timings")
    for key, t in raw["times"].items():
        try:
            op = json.loads(key)
        except ValueError:
            op = None
        if not (isinstance(op, list) and len(op) == 7 and isinstance(op[0], str)):
            raise bad(f"{key[:60]!r} is not an op timing's key")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad(f"the time of {key[:60]!r} is {t!r}, not seconds (a finite number >= 0): the table is damaged")
    return {k: float(t) for k, t in raw["times"].items()}


class MeasuredProvider:
    """Times op variants on this machine (torch eager, warm-up, mean of `repeats` round-robin passes).

    Timing allocates real tensors, so it is bounded, not extrapolated: a decode timing's state (fp32, plus
    the copy that grows it) must fit `budget_bytes` (the batch search stops below it), and a prefill runs
    at most `max_prefill_tokens` (attention's work grows with the square of the length). Beyond either it
    refuses, naming the size: price such scenarios (e.g. long-1m) on an analytic target.

    `timer` and `conditions_fn` are injectable so the caching logic can be tested without a clock.
    """

    max_batch = 256
    measures = True
    max_prefill_tokens = 65536
    budget_bytes = 2 * 2**30

    def __init__(self, cache: Path | None = None, repeats: int = 7, warmup: int = 2, spot_checks: int = 2,
                 tolerance: float = 0.25, timer=time.perf_counter, conditions_fn=None, compute: Compute = CPU):
        """`compute`: the device and precision ops are timed in (on CUDA with events, after synchronising).
        With $PUZZLEKIT_COST_TABLE set (compress sets it to its run's cost-table.json), that file is the cache
        and is not spot-checked: a run prices every round from one table, and a rerun from the same one."""
        pinned = os.environ.get(COST_TABLE_ENV) if cache is None else None
        self.pinned = bool(pinned)  # taken as it is: no spot checks, whatever machine it was timed on
        if pinned:
            cache, spot_checks = Path(pinned), 0
        self.cache_file = cache or cache_dir("cpu-op-times.json")
        self.repeats, self.warmup, self.spot_checks, self.tolerance = repeats, warmup, spot_checks, tolerance
        self.timer, self.compute = timer, compute
        self.conditions = conditions_fn() if conditions_fn else conditions(compute)
        self._cache = self._load()
        self._loaded = set(self._cache)  # times read from disk (not taken by this provider): re-checked once
        self._checked = False  # whether this provider has re-checked the cache it read
        self.invalidated = ""  # why the cache was dropped, when it was
        self.timed = 0  # op timings taken by this provider (spot checks included)

    # -- the cache --------------------------------------------------------------------------------------------
    def _load(self) -> dict:
        if self.pinned and self.cache_file.exists():  # taken as it is: a damaged one is refused, never re-timed
            return read_cost_table(self.cache_file, f"delete it, or unset ${COST_TABLE_ENV}, to time the ops anew")
        try:
            raw = json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict) or not isinstance(raw.get("times"), dict) or (
                raw.get("conditions") != self.conditions and not self.pinned):
            return {}  # written under other conditions (or damaged): not evidence about this machine now
        # a damaged entry (NaN, negative, not a number) is timed again rather than trusted
        return {k: v for k, v in raw["times"].items() if isinstance(v, float) and math.isfinite(v) and v >= 0}

    def _save(self, merge: bool = True) -> None:
        """Writes the times, merged with what other providers wrote to the file since this one read it (each
        CostModel of a run has its own provider: none may drop the others' times)."""
        if merge:
            self._cache = {**self._load(), **self._cache}
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"conditions": self.conditions, "times": self._cache}))
            os.replace(tmp, self.cache_file)
        except OSError as e:  # an unwritable cache: the times serve this run and are timed again in the next
            if self.pinned:  # a run's own table is its record: not keeping it is an error
                raise
            if not getattr(self, "_unkept", False):
                self._unkept = True
                print(f"puzzlekit: op timings not kept for later runs ({self.cache_file}: {e})", file=sys.stderr)

    def invalidate(self, reason: str) -> None:
        """Drops every cached time (they are timed again when next needed)."""
        self._cache.clear()
        self._loaded.clear()
        self.invalidated = reason
        self._save(merge=False)

    def has(self, item: tuple) -> bool:
        """Whether (op, batch, tokens, context, decode) has a time (cached or taken by this provider)."""
        return self.key(*item) in self._cache

    @staticmethod
    def key(op, batch, tokens, context, decode) -> str:
        return json.dumps([op.kind, {k: v for k, v in op.attrs().items() if k != "blocks"},
                           [b.attrs() for b in getattr(op, "blocks", ())], batch, tokens, context, decode],
                          sort_keys=True, default=str)

    # -- bounds -----------------------------------------------------------------------------------------------
    @staticmethod
    def state_bytes(op, batch: int, context: int) -> int:
        """Bytes a decode timing of `op` allocates for its state: fp32, and the copy that appends a token."""
        if not op.is_block:
            return 0
        dims = {"B": batch, "L": context}
        elems = sum(math.prod(dims.get(d, d) for d in shape) for shape in op.state_shapes().values())
        return 2 * 4 * elems

    def batch_limit(self, ops, context: int) -> int:
        """The largest batch (at most max_batch) whose decode timings stay within the memory budget."""
        per = max([self.state_bytes(op, 1, context) for op in ops], default=0)
        return self.max_batch if per == 0 else min(self.max_batch, int(self.budget_bytes // per))

    def check(self, items: list[tuple]) -> None:
        for it in items:
            self._check(*it)

    def _check(self, op, batch, tokens, context, decode) -> None:
        """Refuses what this provider cannot time here (a prefill too long, a decode state too large)."""
        if not decode and batch * tokens > self.max_prefill_tokens:
            raise PuzzlekitError(f"the measured cpu provider runs every prefill it prices; {batch * tokens:,} tokens "
                                 f"is above its bound of {self.max_prefill_tokens:,}: {FIX}")
        need = self.state_bytes(op, batch, context) if decode else 0
        if need > self.budget_bytes:
            raise PuzzlekitError(f"timing a {op.kind} decode step at batch {batch}, context {context:,} would "
                                 f"allocate {need / 1e9:.1f} GB on this machine, above the measured cpu provider's "
                                 f"budget of {self.budget_bytes / 1e9:.1f} GB: {FIX}")

    # -- timing -----------------------------------------------------------------------------------------------
    def times(self, items: list[tuple]) -> list[float]:
        """Seconds for each (op, batch, tokens, context, decode): cached ones (re-checked once per provider),
        the rest timed together in one round-robin."""
        self.check(items)
        keys = [self.key(*it) for it in items]
        if not self._checked:
            cached = list(dict.fromkeys(k for k in keys if k in self._loaded))[: self.spot_checks]
            if cached:
                self._spot_check([items[keys.index(k)] for k in cached], cached)
        if any(k not in self._cache for k in keys):  # another provider may have timed them since: one time per op
            self._cache = {**self._load(), **self._cache}
        todo = {k: it for k, it in zip(keys, items) if k not in self._cache}
        if todo:
            self._cache.update(zip(todo, self._measure(list(todo.values()))[0]))
            self._save()
        return [self._cache[k] for k in keys]

    def prefetch(self, items: list[tuple]) -> None:
        """Times together the items not timed yet (a step's ops, so that load moves them alike)."""
        self.times(items)

    def prepare(self, items: list[tuple]) -> bool:
        """A search's variants timed with the ops priced before them (the parent's) again, so their times
        compare like with like; only the missing ones with a pinned table or when all are cached. True when
        earlier times were replaced."""
        if self.pinned or all(self.has(it) for it in items):
            self.times(items)
            return False
        self.measure_together(items, [])
        return True

    def seconds(self, op, precisions, routing, batch, tokens, context, decode, deployment) -> float:
        """The op's time here at the shape (precision, routing and layout do not change what is timed)."""
        return self.times([(op, batch, tokens, context, decode)])[0]

    def _spot_check(self, items, keys) -> None:
        self._checked = True
        for k, fresh in zip(keys, self._measure(items)[0]):
            old = self._cache[k]
            if old <= 0 or abs(fresh / old - 1) > self.tolerance:
                self.invalidate(f"a cached time re-measured at {fresh / old if old > 0 else math.inf:.2f}x its "
                                f"cached value (tolerance {self.tolerance:.0%})")
                return

    def _measure(self, items: list[tuple], extra: list = ()) -> tuple[list[float], list[float]]:
        """Medians of round-robin timings of the ops in `items` (and of the callables in `extra`, in the same
        turns), in groups whose decode states fit the memory budget together."""
        groups, group, used = [], [], 0
        for it in items:
            need = self.state_bytes(*it[:2], it[3]) if it[4] else 0
            if group and used + need > self.budget_bytes:
                groups.append(group)
                group, used = [], 0
            group.append(it)
            used += need
        groups.append(group)
        out, more = [], []
        for i, g in enumerate(groups):
            runs = [self._runner(*it) for it in g] + (list(extra) if i == len(groups) - 1 else [])
            got = self.interleaved(runs)
            out, more = out + got[:len(g)], got[len(g):]
        return out, more

    def measure_together(self, items: list[tuple], extra: list) -> tuple[list[float], list[float]]:
        """Times ops and other callables (whole models) in the same turns, so they can be compared; the op
        times replace the cached ones."""
        self.check(items)
        ops, more = self._measure(items, extra)
        self.store(items, ops)
        return ops, more

    def store(self, items: list[tuple], seconds: list[float]) -> None:
        """Keeps fresh times; a pinned table's times are never replaced (only the ops it lacks are added)."""
        self._cache.update({k: t for k, t in ((self.key(*it), t) for it, t in zip(items, seconds))
                            if not (self.pinned and k in self._cache)})
        self._save()

    def interleaved(self, runs: list) -> list[float]:
        """Mean seconds of each callable, timed in turns (A, B, C, A, B, C, ...) after warm-up.

        The mean, not the median: on a loaded machine a run is preempted with a probability that grows
        with its length, so a long run (the whole model) almost always includes a pause that short runs
        (single ops) mostly miss. Medians then price the parts below the whole; means stay additive."""
        with torch.no_grad():
            for _ in range(self.warmup):
                for r in runs:
                    r()
            samples = [[] for _ in runs]
            for _ in range(self.repeats):
                for r, s in zip(runs, samples):
                    s.append(self._time(r))
        self.timed += len(runs)
        return [statistics.fmean(s) for s in samples]

    def _time(self, run) -> float:
        return self.compute.time(run, self.timer)

    @torch.no_grad()
    def _runner(self, op, batch, tokens, context, decode):
        runner = self._build_runner(op, batch, tokens, context, decode)
        compute = self.compute

        def run():
            with compute.autocast():
                return runner()
        return run

    @torch.no_grad()
    def _build_runner(self, op, batch, tokens, context, decode):
        g = torch.Generator().manual_seed(0)
        m = op.build().eval()
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        if op.kind == "embed":
            x = torch.randint(0, op.vocab, (batch, tokens), generator=g)
        elif op.kind == "lm_head":
            x = torch.randn(batch, 1, op.hidden, generator=g)
        else:
            x = torch.randn(batch, tokens, op.hidden, generator=g)
        if getattr(op, "tied", False):
            m.bind(torch.nn.Embedding(op.vocab, op.hidden, device=self.compute.device))
        state = None
        if op.is_block and decode and op.state_shapes():
            state = tuple(torch.randn(*[{"B": batch, "L": context}.get(d, d) for d in shape], generator=g)
                          for shape in op.state_shapes().values())
        device = self.compute.device
        m, x = m.to(device), x.to(device)
        state = None if state is None else tuple(t.to(device) for t in state)
        if op.is_block:  # the runtime hands states back in one layout (ProgramModule.contiguous_state): so here
            return lambda: [t.contiguous() for t in m(x, state, decode)[1]]
        return lambda: m(x)

    def model_runs(self, prog, batch: int, context: int, prefill_tokens: int) -> list:
        """Callables running the whole trunk (the MTP head apart, as the cost model prices it): a decode step
        at `batch` with `context` tokens of state, and a prefill of `prefill_tokens`."""
        from .torch import materialize

        trunk = prog.copy()
        trunk.nodes = [n for n in trunk.nodes if n.op.kind != "mtp"]
        trunk.outputs = trunk.outputs[:1]
        m = materialize(trunk, compute=self.compute)
        g = torch.Generator().manual_seed(0)
        vocab = next(n.op.vocab for n in trunk.nodes if n.op.kind == "embed")
        with torch.no_grad():
            _, state = m.prefill(torch.randint(0, vocab, (batch, context), generator=g))
        tok = torch.randint(0, vocab, (batch,), generator=g)
        prompt = torch.randint(0, vocab, (1, prefill_tokens), generator=g)
        return [lambda: m.decode(tok, state), lambda: m.prefill(prompt)]

    @staticmethod
    def describe() -> dict:
        """What the prices came from: recorded in plan.json and printed by `cost` and the report."""
        return {"provider": "measured", "machine": "this machine (cpu)"}

    def step_overhead(self) -> float:
        return 0.0
