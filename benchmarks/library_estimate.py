"""aiconfigurator-core's own whole-model estimate of Nemotron-3-Super on 8xB200: the library's NemotronH model (its
shipped Super NVFP4 config, every GEMM in NVFP4, FP8 KV) and its aggregated-serving search (continuous batching
with prefills mixed in) on TensorRT-LLM's tables, at the Puzzle-75B report's decode-heavy points (8K in / 64K out at
>= 100 and >= 150 tokens/s per user). An independent figure beside `puzzlekit cost --prices tables` (its own
composition, its own serving model; no puzzlekit code prices it), for docs/cost-model.md.

Run: python benchmarks/library_estimate.py [--layouts 4,1,1 8,1,1 8,1,8 ...]   (tp,attention dp,moe ep; needs the
tables extra). Each layout is one replica; the 8 GPUs hold 8 / (tp x dp) of them.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

from puzzlekit.backends.cost.tables_db import DATABASES, MODE

MODEL = "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4"


def estimate(tp: int, dp: int, ep: int, isl: int, osl: int, tpot_ms: float) -> dict:
    """The library's best aggregated operating point of one replica under a TPOT bound."""
    import aiconfigurator_core
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.config import RuntimeConfig
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    shipped = Path(aiconfigurator_core.__file__).parent / "model_configs"
    folder = Path(tempfile.mkdtemp())
    shutil.copy(shipped / f"{MODEL}_config.json", folder / "config.json")
    shutil.copy(shipped / f"{MODEL}_hf_quant_config.json", folder / "hf_quant_config.json")
    db = perf_database.get_database_view("b200_sxm", "trtllm", DATABASES["trtllm"], database_mode=MODE)
    cfg = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=dp, moe_tp_size=tp * dp // ep, moe_ep_size=ep,
                             gemm_quant_mode="nvfp4", moe_quant_mode="nvfp4", kvcache_quant_mode="fp8",
                             fmha_quant_mode="fp8", comm_quant_mode="half")
    model = get_model(str(folder), cfg, "trtllm")
    summary = get_backend("trtllm").find_best_agg_result_under_constraints(
        model, db, RuntimeConfig(isl=isl, osl=osl, ttft=1e9, tpot=tpot_ms), max_batch_size=1024)
    shutil.rmtree(folder)
    best = summary.get_summary_df().head(1)
    if best.empty:
        return {"batch": 0, "tokens_per_second": 0.0, "tpot_ms": float("nan")}
    row = best.iloc[0]
    return {"batch": int(row["global_bs"]), "tokens_per_second": float(row["tokens/s"]), "tpot_ms": float(row["tpot"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", default=["4,1,1", "8,1,1", "8,1,8", "2,4,8", "1,8,8"])
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the library's notes on fallback rows
    print("| layout (tp, attention dp, moe ep) | per user | batch per replica | TPOT ms | tokens/s on 8xB200 |\n"
          "|---|---|---|---|---|")
    for layout in args.layouts:
        tp, dp, ep = (int(x) for x in layout.split(","))
        for rate in (100, 150):
            r = estimate(tp, dp, ep, 8192, 65536, 1000 / rate)
            replicas = 8 // (tp * dp)
            print(f"| tp{tp} dp{dp} ep{ep} | >= {rate} | {r['batch']} | {r['tpot_ms']:.2f} | "
                  f"{r['tokens_per_second'] * replicas:,.0f} |")


if __name__ == "__main__":
    main()
