"""Deployment scenarios: the `Scenario` fields, their validation, and reading them from TOML files.

Apart because scenarios are chosen and checked (CLI, search, benchmarks) without pricing anything.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import tomllib

from ...errors import PuzzlekitError, read_text
from ...ir.quant.recipe import RECIPES
from ..layout import Layout
from .precision import BYTES

#: the Mamba SSM state cache dtypes the engines take: scenario name -> the engines' (and HF config's) name
SSM_STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SCENARIOS_FILE = Path(__file__).parent.parent / "scenarios.toml"  # package data of puzzlekit.backends


@dataclass(frozen=True)
class Scenario:
    name: str = "custom"
    input_len: int = 2048
    output_len: int = 512
    rate_floor: float = 0.0  # tokens/s each user must see; 0: no floor
    context: int = 0  # tokens of state per request; 0: input_len + output_len
    concurrency: int = 0  # requests to serve at once; 0: as many as fit
    kv_dtype: str = "bf16"
    ssm_dtype: str = "fp32"  # the Mamba SSM state cache (engines: mamba_ssm_cache_dtype); fp32, bf16 or fp16
    act_dtype: str = "bf16"
    recipe: str = ""  # weight precisions by recipe name; "": the program's own (bf16 unless quantized)
    gpus: int = 0  # devices used; 0: all of the target's
    layout: str = ""  # parallel layout ("tp4.ep4.r2", see backends/layout.py); "": the best one is searched
    workspace_bytes: float = 4 * 2**30  # per device: CUDA context, library workspaces, graphs, comm buffers
    prefill_chunk: int = 8192  # tokens prefilled per step; sets the activation peak kept free
    mtp_resident: bool = False  # the MTP head's weights and state loaded (implied by mtp_draft)
    mtp_draft: int = 0  # tokens the MTP head drafts per step (speculative decoding); 0: plain decoding
    mtp_acceptance: float = 0.0  # mean tokens per step with drafting (accepted drafts + the verified one)
    cuda_graphs: bool = True  # decode steps replayed from captured CUDA graphs; off: each kernel a host launch

    def to_toml(self) -> str:
        """The scenario as a scenario file (one table, its fields), which `get_scenario` reads back."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
        return f"[{self.name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())

    @property
    def context_len(self) -> int:
        """The state a request holds at its end: what memory must fit."""
        return self.context or self.input_len + self.output_len

    @property
    def decode_context(self) -> int:
        """The mean context of the requests in a decode batch: in steady state they are spread evenly
        over their outputs, so a step costs what the middle of a request costs (attention is linear in
        the context). An explicit `context` holds every request at that context."""
        return self.context or self.input_len + self.output_len // 2

    def check(self):
        for k in ("kv_dtype", "ssm_dtype", "act_dtype"):
            if getattr(self, k) not in BYTES:
                raise PuzzlekitError(f"scenario {self.name}: {k}={getattr(self, k)!r}; one of {sorted(BYTES)}")
        if self.ssm_dtype not in SSM_STATE_DTYPES:  # what vLLM, SGLang and TensorRT-LLM keep the SSM state in
            raise PuzzlekitError(f"scenario {self.name}: ssm_dtype={self.ssm_dtype!r}; the engines keep the Mamba "
                                 f"state in one of {', '.join(SSM_STATE_DTYPES)}")
        if self.recipe and self.recipe not in RECIPES:
            raise PuzzlekitError(f"scenario {self.name}: unknown recipe {self.recipe!r}; known: {sorted(RECIPES)}")
        if self.input_len < 1 or self.output_len < 0 or self.prefill_chunk < 1:
            raise PuzzlekitError(f"scenario {self.name}: input_len and prefill_chunk must be >= 1, output_len >= 0")
        if not (isinstance(self.workspace_bytes, (int, float)) and math.isfinite(self.workspace_bytes)
                and self.workspace_bytes >= 0):
            raise PuzzlekitError(f"scenario {self.name}: workspace_bytes must be a finite number >= 0, "
                                 f"got {self.workspace_bytes!r}")
        for k in ("rate_floor", "context", "concurrency", "gpus", "mtp_draft"):
            if getattr(self, k) < 0:
                raise PuzzlekitError(f"scenario {self.name}: {k} must be >= 0, got {getattr(self, k)}")
        if self.layout:
            Layout.parse(self.layout)
        if self.mtp_draft and not 1 <= self.mtp_acceptance <= self.mtp_draft + 1:
            raise PuzzlekitError(f"scenario {self.name}: mtp_acceptance={self.mtp_acceptance:g} tokens per step "
                                 f"with {self.mtp_draft} drafted must lie in [1, {self.mtp_draft + 1}]; measure it "
                                 "with mtp-check, or give --mtp-acceptance")
        if self.mtp_acceptance and not self.mtp_draft:
            raise PuzzlekitError(f"scenario {self.name}: mtp_acceptance without mtp_draft; give the tokens drafted "
                                 "per step too (--mtp)")
        return self


def scenarios(path: Path = SCENARIOS_FILE) -> dict[str, Scenario]:
    """The named scenarios of a TOML file: one table per scenario, or the fields of one at the top level
    (named after the file)."""
    try:
        raw = tomllib.loads(read_text(path, "scenario file"))
    except tomllib.TOMLDecodeError as e:
        raise PuzzlekitError(f"{path}: not valid TOML ({e})") from None
    if raw and not any(isinstance(v, dict) for v in raw.values()):
        raw = {Path(path).stem: raw}
    known = {f.name for f in dataclasses.fields(Scenario)} - {"name"}
    out = {}
    for k, v in raw.items():
        unknown = sorted(set(v) - known) if isinstance(v, dict) else ["(not a table)"]
        if unknown:
            raise PuzzlekitError(f"{path}: scenario {k!r} has unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
        for f in dataclasses.fields(Scenario):
            if f.name in v and not _is(v[f.name], f.type):
                raise PuzzlekitError(f"{path}: scenario {k!r}: {f.name} = {v[f.name]!r} is not {_KINDS[f.type][1]}; "
                                     f"{f.name} takes {_KINDS[f.type][1]} (default {f.default!r})")
        try:
            out[k] = Scenario(name=k, **v).check()
        except PuzzlekitError as e:
            raise PuzzlekitError(f"{path}: {e}") from None
    return out


#: a field's annotation -> (the TOML values it takes, in words)
_KINDS = {"int": (int, "an integer"), "float": ((int, float), "a number"), "str": (str, "a string"),
          "bool": (bool, "true or false")}


def _is(value, annotation: str) -> bool:
    """Whether a TOML value fits a field (a bool is not a number here, though Python's bool is an int)."""
    if annotation == "bool" or not isinstance(value, bool):
        return isinstance(value, _KINDS[annotation][0])
    return False


def get_scenario(name: str, **overrides) -> Scenario:
    """A built-in scenario by name, or a TOML file of one (`FILE.toml`, or `FILE.toml:NAME` for one of several)."""
    path, _, pick = name.partition(".toml")
    if _ or Path(name).is_file():
        named = scenarios(Path(path + ".toml" if _ else name))
        pick = pick.lstrip(":") or (next(iter(named)) if len(named) == 1 else "")
        if pick not in named:
            raise PuzzlekitError(f"{name}: name one of its scenarios ({', '.join(named)}) as FILE.toml:NAME")
        base = named[pick]
    else:
        named = scenarios()
        if name not in named:
            raise PuzzlekitError(f"unknown scenario {name!r}; named: {', '.join(named)}; or a .toml file")
        base = named[name]
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None}).check()
