"""Hardware targets: GPUs and nodes (memory, bandwidth, dense peaks per precision), and this CPU.

Numbers are vendor datasheet figures for dense tensor-core math (datasheets print 2:4-sparse peaks,
twice these). Users add targets from a TOML or JSON file with the same fields.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from ..errors import PuzzlekitError

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


H100 = Target("h100", "gpu", 80 * GB, 3.35 * TB, {"bf16": 989e12, "fp8": 1979e12}, "sm_90", 1, 900 * GB, 132, 50e6,
              {"arch": "sm_90", "fp4": False})
H200 = dataclasses.replace(H100, name="h200", memory_bytes=141 * GB, bandwidth=4.8 * TB)
B200 = Target("b200", "gpu", 180 * GB, 7.7 * TB, {"bf16": 2250e12, "fp8": 4500e12, "nvfp4": 9000e12}, "sm_100", 1,
              1800 * GB, 148, 126e6, {"arch": "sm_100", "fp4": True})
#: the local CPU; its numbers are rough and only used by the analytic provider, the measured provider times it
CPU = Target("cpu", "cpu", 24 * GB, 20 * GB, {"fp32": 100e9, "bf16": 50e9})

TARGETS: dict[str, Target] = {t.name: t for t in (H100, H200, B200, CPU)}
TARGETS.update({f"8x{t.name}": t.node(8) for t in (H100, H200, B200)})

_FIELDS = {f.name for f in dataclasses.fields(Target)}


def load_target_file(path: str | Path) -> Target:
    """A target from TOML or JSON: name, memory_gb, bandwidth_tbs, peak_tflops {precision: TFLOP/s}, ..."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PuzzlekitError(f"{path}: cannot read the target file ({e})") from None
    if not isinstance(raw, dict):
        raise PuzzlekitError(f"{path}: a target file holds one table/object of fields")
    conv = {"memory_gb": ("memory_bytes", GB), "bandwidth_tbs": ("bandwidth", TB),
            "interconnect_gbs": ("interconnect_bandwidth", GB)}
    vals = {"kind": "gpu"}
    for k, v in raw.items():
        if k in conv:
            vals[conv[k][0]] = float(v) * conv[k][1]
        elif k == "peak_tflops":
            vals["peak_flops"] = {p: float(x) * 1e12 for p, x in v.items()}
        elif k in _FIELDS:
            vals[k] = v
        else:
            raise PuzzlekitError(f"{path}: unknown target field {k!r}; known: memory_gb, bandwidth_tbs, "
                                 f"peak_tflops, interconnect_gbs, {', '.join(sorted(_FIELDS))}")
    missing = [k for k in ("name", "memory_bytes", "bandwidth", "peak_flops") if k not in vals]
    if vals.get("devices", 1) > 1 and not vals.get("interconnect_bandwidth"):
        missing.append("interconnect_gbs (needed with devices > 1)")
    if missing:
        raise PuzzlekitError(f"{path}: target needs {missing} (memory_gb, bandwidth_tbs, peak_tflops)")
    try:
        return Target(**vals)
    except (TypeError, ValueError) as e:
        raise PuzzlekitError(f"{path}: bad target field ({e})") from None


def get_target(name: str) -> Target:
    """A built-in target by name ("h100", "8xb200", ...) or a target file."""
    if name in TARGETS:
        return TARGETS[name]
    if Path(name).is_file():
        return load_target_file(name)
    raise PuzzlekitError(f"unknown target {name!r}; built-in: {', '.join(TARGETS)}; or pass a .toml/.json file")
