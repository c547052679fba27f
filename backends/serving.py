"""Serving command lines for a checkpoint: vLLM, SGLang and TensorRT-LLM (PyTorch backend), set to what the cost
model priced (parallel layout, context, batch, KV and Mamba SSM cache dtypes, MTP drafting), so that the served
model is the one the search and the bundle's memory plan were made for.

Flags as the engines spell them: vLLM 0.34 (`vllm/engine/arg_utils.py`; `max_num_seqs` is per data-parallel rank,
`vllm/config/scheduler.py`; expert parallel spans all TP x DP ranks, `fused_moe/config.py`), SGLang 0.5.23
(`python/sglang/srt/arg_groups/fields/{parallel,spec,exec_,model,schedule}.py`; `max_running_requests` is split
over the attention-DP ranks, `srt/mem_cache/kv_cache_configurator.py`), TensorRT-LLM `trtllm-serve`
(`tensorrt_llm/commands/serve.py`, YAML keys of `llmapi/llm_args.py`: `KvCacheConfig.dtype`,
`mamba_ssm_cache_dtype`, `enable_attention_dp`; with attention DP each rank schedules its own batch, so
`max_batch_size` is given per rank: read from its executor, not run).

The context asked for never exceeds the checkpoint's `max_position_embeddings` (vLLM's
`ModelConfig._get_and_verify_max_len` and SGLang's `ModelConfig._derive_context_length` refuse more unless an
override variable is set); vLLM gets `--max-num-batched-tokens` beside `--max-num-seqs`, since
`SchedulerConfig.verify_max_model_len` refuses fewer batched tokens than sequences and its default (2,048 on GPUs
under 70 GiB) would refuse a priced batch above it.
"""
from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PuzzlekitError
from ..ir.hf_fields import DEFAULT_CONTEXT, served_context
from .layout import Layout

ENGINES = ("vllm", "sglang", "tensorrt-llm")
TRTLLM_YAML = "trtllm-llm-api.yaml"
#: tokens drafted per step when the head is served but the scenario priced none: `cost --mtp`'s default and
#: what mtp-check measures (tools/common.py --mtp-draft, passes/mtp.py)
DEFAULT_DRAFTS = 3
#: the Mamba SSM state's dtype by the scenario's name for it; the three engines take these three
SSM_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
              "fp16": "float16", "float16": "float16"}
#: KV dtypes the engines' `auto` (the checkpoint's dtype) or FP8 E4M3 cover
KV_AUTO, KV_FP8 = ("bf16", "fp16", "fp32"), ("fp8",)
#: TensorRT-LLM's NemotronH refuses other TP sizes unless attention DP is on (_torch/models/modeling_nemotron_h.py)
TRTLLM_TP = (1, 2, 4, 8)
#: vLLM's default `max_num_batched_tokens` for its API server on GPUs of 70 GiB or more
#: (`EngineArgs.get_batch_defaults`); written at least this, and enough for every priced sequence's draft tokens
VLLM_BATCHED_TOKENS = 8192
BREAK = " \\\n    "  # a shell line continued before a flag


class ServingError(PuzzlekitError):
    """No engine command can express what was priced (a cache dtype the engines lack, a bad draft count)."""


@dataclass(frozen=True)
class Serving:
    model: str  # the checkpoint directory, absolute
    layout: Layout
    context_len: int
    max_batch: int  # requests in flight per replica, as priced
    kv_dtype: str  # "fp8" or "auto" (the checkpoint's dtype)
    ssm_dtype: str  # float32, bfloat16 or float16
    drafts: int  # tokens the MTP head drafts per step; 0: no speculative decoding
    notes: tuple = ()  # apply to every engine
    priced_drafts: int = field(default=0, compare=False)

    def _per_rank(self) -> int:
        return self.layout.requests_per_group(self.max_batch)

    def batched_tokens(self) -> int:
        """vLLM's tokens per scheduler step: each priced sequence with its drafts (vLLM refuses fewer than
        `--max-num-seqs`), and never below its own default for a large GPU."""
        return max(VLLM_BATCHED_TOKENS, self._per_rank() * (1 + self.drafts))

    def vllm(self) -> list[str]:
        L = self.layout
        argv = ["vllm", "serve", self.model, "--trust-remote-code", "--tensor-parallel-size", str(L.tp)]
        argv += ["--data-parallel-size", str(L.dp)] if L.dp > 1 else []
        argv += ["--enable-expert-parallel"] if L.ep > 1 and L.ep == L.group else []
        argv += ["--kv-cache-dtype", self.kv_dtype, "--mamba-ssm-cache-dtype", self.ssm_dtype]
        if self.drafts:
            spec = {"method": "mtp", "num_speculative_tokens": self.drafts}
            argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        return argv + ["--max-model-len", str(self.context_len), "--max-num-seqs", str(self._per_rank()),
                       "--max-num-batched-tokens", str(self.batched_tokens())]

    def sglang(self) -> list[str]:
        L = self.layout  # SGLang's TP group spans the attention-DP groups: attention TP = tp_size / attn_dp_size
        argv = ["python", "-m", "sglang.launch_server", "--model-path", self.model, "--trust-remote-code",
                "--tp-size", str(L.group)]
        argv += ["--attn-dp-size", str(L.dp)] if L.dp > 1 else []
        argv += ["--ep-size", str(L.ep)] if L.ep > 1 else []
        argv += ["--kv-cache-dtype", "fp8_e4m3" if self.kv_dtype == "fp8" else "auto",
                 "--mamba-ssm-dtype", self.ssm_dtype]
        if self.drafts:
            argv += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(self.drafts),
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(self.drafts + 1)]
        return argv + ["--context-length", str(self.context_len), "--max-running-requests", str(self.max_batch)]

    def trtllm(self) -> list[str]:
        L = self.layout
        return ["trtllm-serve", self.model, "--backend", "pytorch", "--tp_size", str(L.group), "--ep_size", str(L.ep),
                "--trust_remote_code", "--max_batch_size", str(self._per_rank()), "--max_seq_len",
                str(self.context_len), "--extra_llm_api_options", TRTLLM_YAML]

    def trtllm_yaml(self) -> str:
        """The LLM API options trtllm-serve reads (--extra_llm_api_options), written without a YAML library."""
        lines = ["# TensorRT-LLM LLM API options for trtllm-serve --extra_llm_api_options (written by puzzlekit)",
                 "kv_cache_config:", f"  dtype: {self.kv_dtype}", f"  mamba_ssm_cache_dtype: {self.ssm_dtype}",
                 "  enable_block_reuse: false"]
        if self.drafts:
            lines += ["speculative_config:", "  decoding_type: MTP", f"  num_nextn_predict_layers: {self.drafts}"]
        if self.layout.dp > 1:
            lines.append("enable_attention_dp: true")
        return "\n".join(lines) + "\n"

    def argv(self, engine: str) -> list[str]:
        if engine not in ENGINES:
            raise ServingError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
        return {"vllm": self.vllm, "sglang": self.sglang, "tensorrt-llm": self.trtllm}[engine]()

    def command(self, engine: str, sep: str = " ") -> str:
        """The engine's command line, quoted for a POSIX shell; `sep` BREAK puts each flag on its own line."""
        parts, out = self.argv(engine), []
        for a in parts:
            q = shlex.quote(a)
            out.append(sep + q if a.startswith("--") and out else (" " + q if out else q))
        return "".join(out)

    def engine_notes(self, engine: str) -> list[str]:
        """What the engine's flags cannot say of the priced layout."""
        L, out = self.layout, list(self.notes)
        if engine == "vllm" and 1 < L.ep < L.group:
            out.append(f"vLLM spreads the experts over all {L.group} GPUs (--enable-expert-parallel) or none; the "
                       f"priced ep{L.ep} has no vLLM form, so the experts are split tensor parallel here")
        if engine == "tensorrt-llm" and L.dp == 1 and L.tp not in TRTLLM_TP:
            out.append(f"TensorRT-LLM's NemotronH accepts TP 1, 2, 4 or 8 only (without attention DP): tp{L.tp} "
                       "will be refused")
        if engine == "tensorrt-llm" and L.dp > 1 and L.tp > 1:
            out.append(f"TensorRT-LLM's attention DP keeps attention whole on each of its {L.group} ranks, not "
                       f"split over {L.tp} as priced")
        return out

    def serve_sh(self) -> str:
        """`bash serve.sh [vllm|sglang|tensorrt-llm] [more engine flags]`: runs from the bundle (for the YAML)."""
        lines = ["#!/usr/bin/env bash", f"# Serves {self.model} as puzzlekit priced it: {self.summary()}.",
                 "# bash serve.sh [vllm|sglang|tensorrt-llm] [more flags for the engine]   (default: vllm)",
                 "set -euo pipefail", 'cd "$(dirname "$0")"', 'engine="${1:-vllm}"',
                 "if [ $# -gt 0 ]; then shift; fi", 'case "$engine" in']
        for engine in ENGINES:
            lines.append(f"  {engine}{'|trtllm' if engine == 'tensorrt-llm' else ''})")
            lines += [f"    # {n}" for n in self.engine_notes(engine)]
            lines.append(f"    exec {self.command(engine, BREAK + '  ')} \"$@\" ;;")
        lines += ["  *) echo \"serve.sh: unknown engine '$engine'; one of: " + ", ".join(ENGINES) + "\" >&2; exit 2 ;;",
                  "esac"]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        mtp = f"MTP drafting {self.drafts} tokens per step" if self.drafts else "no speculative decoding"
        return (f"layout {self.layout}, context {self.context_len}, {self.max_batch} requests per replica, KV cache "
                f"{self.kv_dtype}, Mamba SSM state {self.ssm_dtype}, {mtp}")

    def readme(self) -> str:
        """The bundle README's section with the three commands."""
        out = ["## Serve the checkpoint", "",
               f"`{self.model}` with an engine, as priced: {self.summary()}. `bash serve.sh vllm|sglang|tensorrt-llm` "
               f"runs one of these (more flags after the engine's name go to it); TensorRT-LLM reads {TRTLLM_YAML}.",
               "The checkpoint loads with remote code (its configuration and modeling files): --trust-remote-code."]
        for engine, name in zip(ENGINES, ("vLLM", "SGLang", "TensorRT-LLM")):
            out += ["", f"{name}:", "", "```bash", self.command(engine, BREAK), "```"]
            out += [f"- {n}" for n in self.engine_notes(engine) if n not in self.notes]
        return "\n".join(out + ([""] + [f"Note: {n}" for n in self.notes] if self.notes else [])) + "\n"

    def to_json(self) -> dict:
        return {"model": self.model, "layout": str(self.layout), "context_len": self.context_len,
                "max_batch": self.max_batch, "vllm_max_num_batched_tokens": self.batched_tokens(),
                "kv_cache_dtype": self.kv_dtype, "ssm_cache_dtype": self.ssm_dtype,
                "mtp_draft_tokens": self.drafts, "priced_draft_tokens": self.priced_drafts,
                "files": ["serve.sh", TRTLLM_YAML], "commands": {e: self.argv(e) for e in ENGINES},
                "notes": {e: self.engine_notes(e) for e in ENGINES}}


def _config(checkpoint) -> dict:
    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ServingError(f"{checkpoint}: no readable config.json ({e}); the serving commands read the checkpoint's "
                           "MTP head and context from it") from None
    if not isinstance(cfg, dict):
        raise ServingError(f"{checkpoint}/config.json is not a JSON object")
    return cfg


def has_mtp(source) -> bool:
    """Whether the model has an MTP head: a Program, or a checkpoint directory (its config.json)."""
    if hasattr(source, "find"):
        return bool(source.find("mtp"))
    cfg = _config(source)
    return bool(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_block_configs"))


def measured_drafts(prog) -> int | None:
    """The draft count mtp-check measured the head's acceptance at, kept in the program's provenance."""
    meta = getattr(prog, "meta", {}) or {}
    prov = meta.get("provenance") or meta.get("config", {}).get("provenance") or {}
    return (prov.get("mtp_acceptance") or {}).get("drafts")


def serving(source, checkpoint, layout: Layout | str, scenario, max_batch: int, drafts: int | None = None,
            ssm_dtype: str | None = None) -> Serving:
    """The serving commands for `checkpoint` (served as its absolute path) priced as `scenario` in `layout` with
    `max_batch` requests per replica. `source` (the program or the checkpoint directory) says whether there is
    an MTP head. `drafts`: tokens drafted per step (0: none; default: the scenario's, else the measured or
    DEFAULT_DRAFTS when the head is served unpriced). `ssm_dtype`: default the scenario's (puzzlekit prices fp32)."""
    if not Path(checkpoint).is_dir():
        raise ServingError(f"{checkpoint}: not a checkpoint directory; the serving commands name the one to serve")
    layout = Layout.parse(layout) if isinstance(layout, str) else layout.check()
    if scenario.kv_dtype not in KV_AUTO + KV_FP8:
        raise ServingError(f"scenario {scenario.name}: KV cache {scenario.kv_dtype}: the serving commands cover "
                           f"{', '.join(KV_AUTO + KV_FP8)}")
    ssm = ssm_dtype or scenario.ssm_dtype
    if ssm not in SSM_DTYPES:
        raise ServingError(f"Mamba SSM cache dtype {ssm!r}: the engines take float32, bfloat16 or float16")
    notes = []
    mtp = has_mtp(source)
    if drafts is None:
        drafts = scenario.mtp_draft or (measured_drafts(source) or DEFAULT_DRAFTS if mtp else 0)
    if drafts < 0 or (drafts and not mtp):
        raise ServingError(f"{drafts} draft tokens: " + ("must be >= 0" if drafts < 0 else "the model has no MTP head"))
    if drafts and not scenario.mtp_draft:
        notes.append(f"the cost model priced plain decoding (scenario {scenario.name} drafts no tokens); the MTP head "
                     f"drafts {drafts} here: drop the speculative flags to serve exactly as priced")
    if layout.replicas > 1:
        notes.append(f"layout {layout}: run one server per replica ({layout.replicas}), each on its own {layout.group} "
                     "GPU(s) (CUDA_VISIBLE_DEVICES) and port, behind a load balancer")
    cfg = _config(checkpoint)
    context = min(scenario.context_len, held := served_context(cfg))
    if context < scenario.context_len:
        stated = ("its max_position_embeddings" if cfg.get("max_position_embeddings") else
                  f"it states no max_position_embeddings, so the engines assume {DEFAULT_CONTEXT:,}")
        notes.append(f"scenario {scenario.name} priced a {scenario.context_len:,}-token context, but the checkpoint "
                     f"holds {held:,} ({stated}); the engines refuse more, so these commands ask for {context:,}")
    return Serving(str(Path(checkpoint).resolve()), layout, context, max(1, math.ceil(max_batch)),
                   "fp8" if scenario.kv_dtype in KV_FP8 else "auto", SSM_DTYPES[ssm], int(drafts), tuple(notes),
                   scenario.mtp_draft)
