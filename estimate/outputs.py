"""What `compress` does after it writes the child (tools/compress_outputs.py), estimated as one stage: the report's
evaluations of parent and child, the frontier's searches and the deployment bundle.

The work is described by the caller (`Outputs`: how many report windows, prompts and tokens; the target), so this
module knows the report's sizes without importing the command. The bundle's rates are measured (below); the rest
is priced as the other stages price a forward and a search.
"""
from __future__ import annotations

from dataclasses import dataclass

from .stages import ACCEPTANCE_GUESS, SEARCH_SECONDS, Context, Stage, _batches, speculative

#: the frontier's searches: one search priced once and planned at 5 budgets x 3 methods, and the engine-free
#: search of the engine profile's cost (Super's config on 8xB200: 11.1 s + 1.8 s against a 10.7 s plan)
FRONTIER_SEARCHES = 1.2
#: the ONNX bundle: seconds per layer (tracing, stitching, optimizing and checking its graph: the nodes do not grow
#: with a layer's experts, stacked in one initializer) and seconds per GB of the child's float32 weights (copied
#: into both graphs, written, checked, read back for the golden outputs). Fitted on the Super-counts miniature's
#: child (88 layers, 0.2 GB: 51 s) and an 8-layer model of 1.1 GB (62 s); checked on a 44-layer, 64-expert one
#: (predicted 25.5 s, measured 26.4 s). A cpu target's ONNX graphs alone took 12% less; the FP8 KV cache's
#: rewrite of both graphs is not measured (its calibration forward is counted)
EXPORT_PER_LAYER, EXPORT_PER_GB = 0.46, 51.3
#: the bundle's peak host memory in copies of the child's float32 weights: the materialised module, both graphs
#: held until written, the golden outputs' sessions (measured: 8.44 GB for a 1.13 GB child)
EXPORT_COPIES = 7.5
#: the report page and its charts (measured: 6 s on the Super-counts miniature's run)
REPORT_PAGE_SECONDS = 6.0


@dataclass(frozen=True)
class Outputs:
    """The work after the child is written: `windows` report windows of `seq` tokens (each model run once over
    them, its logits built twice: the agreement with the parent and the text figures), `prompts` MTP prompts of
    `prompt_len` tokens decoding `new_tokens` with `drafts` drafts where the model has a head, the frontier's
    searches, and the bundle for `target_kind` ("cpu": ONNX graphs; "gpu": the engine bundle, `fp8_kv` with its
    KV cache calibrated over `calibration` windows x tokens)."""

    windows: int
    seq: int
    prompts: int
    prompt_len: int
    new_tokens: int
    drafts: int = 3
    target_kind: str = "cpu"
    fp8_kv: bool = False
    calibration: tuple = (16, 128)
    batch: int = 8  # report windows run together


def outputs(parent: Context, child: Context, work: Outputs) -> Stage:
    """Parent and child streamed side by side for the report, the searches on the host, then the child
    materialised for its ONNX export."""
    weights = 4.0 * (parent.params() + child.params())
    quality = 0.0
    rows = min(work.windows, work.batch)
    for ctx in (parent, child):  # each model once over the windows (its hidden states kept), its logits twice
        once = ctx.forward(rows, work.seq) + 2 * ctx.rates.forward(ctx.head(), rows, work.seq)
        quality += _batches(work.windows, work.batch) * once
        if ctx.mtp():
            quality += work.prompts * speculative(ctx, work.prompt_len, work.new_tokens, work.drafts,
                                                  ACCEPTANCE_GUESS)
    quality += 2 * parent.reads(weights)  # the windows' pass and the prompts' (as the MTP check's)
    search = FRONTIER_SEARCHES * (SEARCH_SECONDS[0] + SEARCH_SECONDS[1] * len(parent.blocks()))
    layers = len(child.blocks()) + (len(child.mtp().blocks) if child.mtp() else 0)
    bundle = EXPORT_PER_LAYER * layers + EXPORT_PER_GB * 4.0 * child.params() / 1e9
    if work.fp8_kv:
        bundle += child.forward(min(work.calibration[0], work.batch), work.calibration[1]) \
            * _batches(work.calibration[0], work.batch)
    quality += REPORT_PAGE_SECONDS
    notes = [f"report {quality:.0f} s, frontier {search:.0f} s, "
             f"{'engine bundle' if work.target_kind == 'gpu' else 'ONNX graphs'} {bundle:.0f} s"]
    export = {"the bundle's export (module, graphs, golden check)": EXPORT_COPIES * 4.0 * child.params()}
    if child.device == "cpu":  # one step at a time: the larger of the report's streams and the export
        streams = parent.streamed(weights)
        return child.stage("outputs", max(streams, export, key=lambda m: sum(m.values())), quality + search + bundle,
                           ["a smaller --max-memory"], notes, alone=True)
    return child.stage("outputs", parent.streamed(weights), quality + search + bundle, ["a smaller --max-memory"],
                       notes, host=export, alone=True)  # the export runs on the host
