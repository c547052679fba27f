"""The block library on disk, and the variants' starting weights.

A library is a directory built once per parent model and reused for every target:

    manifest.json                 parent (hash, source, program text), grid, the held-out set scored on, one row
                                  per variant
    importance.json               the ranks the variants were sliced by
    variants/L{layer:03d}/{id}.safetensors   a variant's (BLD-trained) block weights, local names
    variants/L{layer:03d}/{id}.json          its row: spec, sizes, init, BLD and scores (written atomically)

A variant's weights and its row so far (`{id}.bld.json`) are written once it is trained, its row once it is
scored, so a killed build resumes where it stopped, per variant; the manifest is assembled from the rows. A
library belongs to one parent: opening it with another model is refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...ir import Program
from ...ir.identity import program_hash
from ...ir.checkpoint import spec_from_dict, spec_to_dict
from ...ir.weights import lazy_tensors
from ...ir.ops import Linear, Noop, OpSpec
from ...outputs import write_json
from ..core import PassError
from .grid import Variant

MANIFEST = "manifest.json"
#: 2: the scores are measured on the held-out `scoring` set alone (data.HELD_OUT); 1's were on all the held-out
#: text, which reported figures now use, so a /1 library is refused rather than reused
FORMAT = "puzzlekit-block-library/2"
SCORED_ON = "scoring"


class LibraryError(PassError):
    """A library directory is missing, incomplete, or belongs to another parent."""


#: the parent's identity (a library, its later rounds and distillation runs compare it)
parent_hash = program_hash


def _keep(ax, ranks, n: int):
    """The first `n` units by rank: per group for grouped axes, per unit (expert) for per-unit axes."""
    if not ax.ranked:
        return list(range(n))
    if ax.per_unit:
        return [r[:n] for r in ranks]
    if ax.groups > 1:
        per, m = ax.size // ax.groups, n // ax.groups
        return [g * per + i for g, rk in enumerate(ranks) for i in rk[:m]]
    return ranks[:n]


def slice_variant(op: OpSpec, weights: dict, variant: Variant, ranks: dict) -> tuple[OpSpec, dict]:
    """The variant's spec and weights sliced from the parent block in importance order."""
    spec, w = op, dict(weights)
    for axis, n in variant.steps:
        spec, w = spec.shrink(axis, _keep(spec.axes()[axis], ranks.get(axis), n), w)
    return spec, w


def replacement_spec(op: OpSpec, kind: str) -> OpSpec:
    return Noop(op.hidden) if kind == "noop" else Linear(op.hidden, eps=op.eps)


def variant_spec(op: OpSpec, variant: Variant) -> OpSpec:
    """The variant's spec alone (no weights): what a weightless library records."""
    if variant.replacement:
        return replacement_spec(op, variant.replacement)
    for axis, n in variant.steps:
        op = op.resized(axis, n)
    return op


def layer_dir(lib: Path, layer: int) -> Path:
    return lib / "variants" / f"L{layer:03d}"


def safe_id(vid: str) -> str:
    return vid.replace("=", "-").replace(",", "_")


class Library:
    """A library directory read back: rows by layer, and each variant's weights."""

    def __init__(self, path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self.rows = manifest["variants"]
        self._specs: dict = {}  # (layer, id) -> (its spec dict, the spec): specs are immutable

    @classmethod
    def open(cls, path, parent: Program | None = None) -> Library:
        """Reads LIB/manifest.json; with `parent`, refuses a library built from another model."""
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            raise LibraryError(f"{path} holds no {MANIFEST}; build one with `puzzlekit library MODEL -o {path}`") \
                from None
        except (OSError, ValueError) as e:
            raise LibraryError(f"{path / MANIFEST}: cannot read it ({e})") from None
        check_format(manifest, path)
        lib = cls(path, manifest)
        if parent is not None:
            lib.check(parent)
        return lib

    def check(self, parent: Program) -> None:
        """Refuses a parent other than the one the library was built from."""
        built, given = self.manifest["parent"], parent_hash(parent)
        if built["hash"] != given:
            raise LibraryError(f"library {self.path} was built for another parent ({built['source']}, hash "
                               f"{built['hash'][:12]}), not this model (hash {given[:12]}); build a library for it "
                               "with `puzzlekit library`")

    @property
    def weightless(self) -> bool:
        return self.manifest["weightless"]

    def layers(self) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for r in self.rows:
            out.setdefault(r["layer"], []).append(r)
        return out

    def spec(self, row: dict) -> OpSpec:
        key = (row["layer"], row["id"])
        hit = self._specs.get(key)
        if hit is None or hit[0] is not row["spec"]:  # read once per variant: a search asks at every batch
            hit = self._specs[key] = (row["spec"], spec_from_dict(row["spec"], f"{self.path}: variant {key[0]}/{key[1]}"))
        return hit[1]

    def weights(self, row: dict, lazy: bool = False) -> dict:
        """The variant's weights by local name; `lazy`: unread (read from the library when used), so that a
        child realised from the library holds no more in memory than its parent did."""
        if self.weightless:
            raise LibraryError(f"library {self.path} is weightless (built from a config); it has no variant weights")
        if not self.spec(row).params():
            return {}  # noop
        f = layer_dir(self.path, row["layer"]) / f"{safe_id(row['id'])}.safetensors"
        if not f.exists():
            raise LibraryError(f"library {self.path} lacks the weights of variant {row['layer']}/{row['id']} ({f})")
        if lazy:
            return lazy_tensors(f)
        return load_file(str(f))


def check_format(record, lib: Path) -> None:
    """Refuses a manifest (or build record) of another format; a /1 library's scores were measured on held-out
    text that reported figures now use, so it is to be built again rather than reused."""
    got = record.get("format") if isinstance(record, dict) else None
    if got == FORMAT:
        return
    if got == "puzzlekit-block-library/1":
        raise LibraryError(f"{lib} holds a {got} library: its scores were measured on held-out text that reported "
                           f"figures now use (a {FORMAT} library is scored on the `{SCORED_ON}` set alone); build it "
                           f"again with `puzzlekit library MODEL -o NEW_DIR`, or remove {lib} and rerun")
    raise LibraryError(f"{lib / MANIFEST} is not a {FORMAT} manifest")


#: a trained variant's row before its scores: it marks the variant's weights as written
TRAINED = ".bld.json"


def save_trained(lib: Path, layer: int, vid: str, weights: dict, row: dict) -> None:
    """A trained variant's weights, then its row so far (which marks them complete)."""
    d = layer_dir(lib, layer)
    d.mkdir(parents=True, exist_ok=True)
    if weights:
        f = d / f"{safe_id(vid)}.safetensors"
        tmp = d / f".{f.name}.tmp"
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, f)
    write_json(d / f"{safe_id(vid)}{TRAINED}", row)


def load_trained(lib: Path, layer: int, vid: str) -> tuple[dict, dict] | None:
    """(row so far, weights) of a variant trained but not yet scored, or None."""
    d = layer_dir(lib, layer)
    f = d / f"{safe_id(vid)}{TRAINED}"
    if not f.exists():
        return None
    row, weights = json.loads(f.read_text()), d / f"{safe_id(vid)}.safetensors"
    if row["params"] and not weights.exists():
        return None  # trained again
    return row, load_file(str(weights)) if row["params"] else {}


def save_row(lib: Path, layer: int, vid: str, row: dict) -> None:
    """The scored variant's row (it marks the variant done), and its trained record gone."""
    d = layer_dir(lib, layer)
    write_json(d / f"{safe_id(vid)}.json", row)
    (d / f"{safe_id(vid)}{TRAINED}").unlink(missing_ok=True)


def load_row(lib: Path, layer: int, vid: str) -> dict | None:
    f = layer_dir(lib, layer) / f"{safe_id(vid)}.json"
    return json.loads(f.read_text()) if f.exists() else None


def variant_label(row: dict) -> str:
    """A variant as people read it (plan, report, JSON): the attributes its shrinks changed, valued as its spec
    has them (a Mamba layer's `state` per group, not the axis' count of channels over all groups, which is what
    the id, the library's key, records)."""
    if row["replacement"]:
        return row["replacement"]
    return ",".join(f"{axis}={row['spec'].get(axis, n)}" for axis, n in row["steps"]) or "parent"


def row_of(layer: int, path: str, variant: Variant, spec: OpSpec) -> dict:
    params = sum(torch.Size(s).numel() for s in spec.params().values())
    return {"layer": layer, "path": path, "id": variant.id, "kind": spec.kind, "spec": spec_to_dict(spec),
            "steps": [list(s) for s in variant.steps], "replacement": variant.replacement,
            "params": params, "active_params": spec.active_params()}
