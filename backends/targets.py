"""Hardware targets: GPUs and nodes (memory, bandwidth, dense peaks per precision), and this CPU.

Numbers are vendor datasheet figures for dense tensor-core math (datasheets print 2:4-sparse peaks,
twice these). Users add targets from a TOML or JSON file with the same fields.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from ..errors import PuzzlekitError, read_text

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: float  # per device
    bandwidth: float  # memory bytes/s per device
    peak_flops: dict  # precision -> dense FLOP/s per device
    compute_capability: str = ""
    devices: int = 1
    interconnect_bandwidth: float = 0.0  # bytes/s per device (NVLink), for tensor-parallel all-reduce
    sms: int = 0
    l2_bytes: float = 0.0
    trt: dict = field(default_factory=dict)  # TensorRT builder defaults for this target

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(self.peak_flops)

    def supports(self, precision: str) -> bool:
        return precision in self.peak_flops

    def node(self, devices: int) -> Target:
        return dataclasses.replace(self, name=f"{devices}x{self.name}", devices=devices)


MIB = 2**20
#: memory is what the driver reports (nvidia-smi: 81559 / 143771 / 183359 MiB): the "80 / 141 / 180 GB" of the
#: datasheets are binary gigabytes, less what the driver keeps. `trt`: the engine builder ("tensorrt", or
#: "tensorrt-rtx", which builds ahead of time without the GPU) and the recipe an engine bundle uses by default
H100 = Target("h100", "gpu", 81559 * MIB, 3.35 * TB, {"bf16": 989e12, "fp8": 1979e12}, "sm_90", 1, 900 * GB, 132, 50e6,
              {"arch": "sm_90", "fp4": False, "builder": "tensorrt", "recipe": "fp8"})
H200 = dataclasses.replace(H100, name="h200", memory_bytes=143771 * MIB, bandwidth=4.8 * TB)
B200 = Target("b200", "gpu", 183359 * MIB, 7.7 * TB, {"bf16": 2250e12, "fp8": 4500e12, "nvfp4": 9000e12}, "sm_100", 1,
              1800 * GB, 148, 126e6, {"arch": "sm_100", "fp4": True, "builder": "tensorrt", "recipe": "nvfp4"})
# Workstation GPUs that TensorRT-RTX builds engines for without the GPU present (approx. dense figures of an
# RTX 5090 and an RTX 4090). They prove here that every graph builds; their engines run on those GPUs.
RTX_SM120 = Target("rtx-sm120", "gpu", 32 * GB, 1.79 * TB, {"bf16": 209e12, "fp8": 419e12, "nvfp4": 838e12}, "sm_120",
                   sms=170, l2_bytes=96e6, trt={"arch": "sm_120", "fp4": True, "builder": "tensorrt-rtx",
                                                "recipe": "nvfp4"})
RTX_SM89 = Target("rtx-sm89", "gpu", 24 * GB, 1.01 * TB, {"bf16": 165e12, "fp8": 330e12}, "sm_89", sms=128,
                  l2_bytes=72e6, trt={"arch": "sm_89", "fp4": False, "builder": "tensorrt-rtx", "recipe": "fp8"})
#: the local CPU; its numbers are rough and only used by the analytic provider, the measured provider times it
CPU = Target("cpu", "cpu", 24 * GB, 20 * GB, {"fp32": 100e9, "bf16": 50e9})

TARGETS: dict[str, Target] = {t.name: t for t in (H100, H200, B200, RTX_SM120, RTX_SM89, CPU)}
TARGETS.update({f"8x{t.name}": t.node(8) for t in (H100, H200, B200)})

#: precisions a target file may give peaks for (the math precisions the cost model prices)
PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "nvfp4")


def _number(path, key: str, v, scale: float = 1.0, zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with `zero`) times `scale`: a string, list, NaN or negative is refused
    here, before it prices a model at NaN or infinite speed."""
    try:
        x = float(v) * scale if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        x = math.inf
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
        raise PuzzlekitError(f"{path}: {key} must be a finite number {'>=' if zero else '>'} 0, got {v!r}")
    return x


def _integer(path, key: str, v, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise PuzzlekitError(f"{path}: {key} must be an integer >= {least}, got {v!r}")
    return v


def _table(path, key: str, v) -> dict:
    if not isinstance(v, dict):
        raise PuzzlekitError(f"{path}: {key} must be a table, got {v!r}")
    return v


def _peaks(path, v) -> dict:
    if not _table(path, "peak_tflops", v):
        raise PuzzlekitError(f"{path}: peak_tflops is empty; give {{precision = TFLOP/s}} for at least bf16")
    unknown = sorted(set(v) - set(PRECISIONS))
    if unknown:
        raise PuzzlekitError(f"{path}: peak_tflops has unknown precision(s) {unknown}; known: {', '.join(PRECISIONS)}")
    return {p: _number(path, f"peak_tflops.{p}", x, 1e12) for p, x in v.items()}


def _text(path, key: str, v, choices=()) -> str:
    if not (isinstance(v, str) and (v.strip() or key != "name") and (not choices or v in choices)):
        want = f"one of {', '.join(choices)}" if choices else "a non-empty string" if key == "name" else "a string"
        raise PuzzlekitError(f"{path}: {key} must be {want}, got {v!r}")
    return v


#: file field -> how it is checked and which Target field it fills
_FILE_FIELDS = {
    "name": ("name", lambda p, v: _text(p, "name", v)),
    "kind": ("kind", lambda p, v: _text(p, "kind", v, ("gpu", "cpu"))),
    "memory_gb": ("memory_bytes", lambda p, v: _number(p, "memory_gb", v, GB)),
    "bandwidth_tbs": ("bandwidth", lambda p, v: _number(p, "bandwidth_tbs", v, TB)),
    "peak_tflops": ("peak_flops", _peaks),
    "interconnect_gbs": ("interconnect_bandwidth", lambda p, v: _number(p, "interconnect_gbs", v, GB)),
    "compute_capability": ("compute_capability", lambda p, v: _text(p, "compute_capability", v)),
    "devices": ("devices", lambda p, v: _integer(p, "devices", v, 1)),
    "sms": ("sms", lambda p, v: _integer(p, "sms", v, 0)),
    "l2_bytes": ("l2_bytes", lambda p, v: _number(p, "l2_bytes", v, zero=True)),
    "trt": ("trt", lambda p, v: _table(p, "trt", v)),
}


def load_target_file(path: str | Path) -> Target:
    """A target from TOML or JSON: name, memory_gb, bandwidth_tbs, peak_tflops {precision: TFLOP/s}, ...

    Every field is checked for its type and range, naming the field, before anything is priced."""
    path = Path(path)
    text = read_text(path, "target file")
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except ValueError as e:
        raise PuzzlekitError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({e})") from None
    if not isinstance(raw, dict):
        raise PuzzlekitError(f"{path}: a target file holds one table/object of fields")
    vals = {"kind": "gpu"}
    for k, v in raw.items():
        if k not in _FILE_FIELDS:
            raise PuzzlekitError(f"{path}: unknown target field {k!r}; known: {', '.join(_FILE_FIELDS)}")
        field_name, check = _FILE_FIELDS[k]
        vals[field_name] = check(path, v)
    missing = [k for k in ("name", "memory_gb", "bandwidth_tbs", "peak_tflops") if _FILE_FIELDS[k][0] not in vals]
    if vals.get("devices", 1) > 1 and not vals.get("interconnect_bandwidth"):
        missing.append("interconnect_gbs (needed with devices > 1)")
    if missing:
        raise PuzzlekitError(f"{path}: target needs {', '.join(missing)}")
    return Target(**vals)


def get_target(name: str) -> Target:
    """A built-in target by name ("h100", "8xb200", ...) or a target file."""
    if name in TARGETS:
        return TARGETS[name]
    try:
        is_file = Path(name).is_file()
    except (OSError, ValueError):  # not a usable path
        is_file = False
    if is_file:
        return load_target_file(name)
    raise PuzzlekitError(f"unknown target {name!r}; built-in: {', '.join(TARGETS)}; or pass a .toml/.json file")
