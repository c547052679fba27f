"""Miniatures of the family: a seeded transformers `NemotronHForCausalLM` built from any Nemotron-H config (a
shipped one by name, or the user's), with every count and block kind kept and every width shrunk, so that a
command can be tried on a model of that member's structure in seconds, without its weights.

Kept: routed experts and top-k, query / KV / Mamba heads and groups, the MTP head's form, the config's form (a
pattern string or block-type lists) and its other fields. Shrunk: hidden size, head sizes, SSM state, expert,
shared-expert, latent and MLP widths, the vocabulary (to the tokenizer's), and the layers, cut to the shortest
prefix that holds every kind of the full model. transformers builds the trunk; the MTP head, which its
NemotronH does not build, is written beside it under the published tensor names (`mtp.layers.{i}...`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..ir.hf_fields import FLOAT32_MAX, kinds_of

#: widths a miniature takes (each only where the config has the field)
WIDTHS = {"hidden_size": 32, "head_dim": 8, "mamba_head_dim": 4, "ssm_state_size": 8, "chunk_size": 16,
          "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24, "intermediate_size": 48}
LATENT = 16
#: transformers' spelling of each layer kind (its pattern letters: M E * -)
HF_TYPE = {"mamba2": "mamba", "moe": "moe", "attention": "attention", "mlp": "mlp"}
LETTER = {"mamba2": "M", "moe": "E", "attention": "*", "mlp": "-"}


def layer_kinds(cfg: dict) -> list[str]:
    """The trunk's layer kinds (mamba2, moe, attention, mlp), from either config form (checked as a load does)."""
    field = "layers_block_type" if cfg.get("layers_block_type") is not None else "hybrid_override_pattern"
    return kinds_of(cfg.get(field) or "", field, "the config")


def shortest_prefix(kinds: list[str]) -> int:
    """The length of the shortest prefix of `kinds` holding every kind the whole list holds."""
    want, seen = set(kinds), set()
    for i, k in enumerate(kinds):
        seen.add(k)
        if seen == want:
            return i + 1
    return len(kinds)


def miniature_config(cfg: dict, vocab_size: int, layers: int | None = None) -> dict:
    """`cfg` with its widths shrunk and its layers cut (to `layers`, default the shortest prefix holding every
    kind), in the same form (pattern string or lists) as `cfg`; counts and every other field as they are."""
    kinds = layer_kinds(cfg)
    n = layers or shortest_prefix(kinds)
    out = dict(cfg)
    out.pop("quantization_config", None)  # the miniature holds full-precision weights
    for k, v in WIDTHS.items():
        if k in cfg or k in ("hidden_size", "head_dim"):
            out[k] = v
    out.pop("attention_head_dim", None)  # the older spelling of head_dim
    if cfg.get("moe_latent_size"):
        out["moe_latent_size"] = LATENT
    if isinstance(cfg.get("layers_block_type"), list):
        out["layers_block_type"] = [HF_TYPE[k] for k in kinds[:n]]
    else:
        out["hybrid_override_pattern"] = "".join(LETTER[k] for k in kinds[:n])
    if "num_hidden_layers" in cfg:
        out["num_hidden_layers"] = n
    out |= {"vocab_size": vocab_size, "dtype": "float32", "max_position_embeddings": 4096}
    out.pop("torch_dtype", None)
    return out


def seeded_init(model, seed: int, std: float | None = None):
    """Seeded weights of O(1) effect per layer (transformers' init is tiny: routing and logits would decide
    nothing): A_log spread over heads, dt_bias near softplus^-1 of a small step, norms near 1, the rest of
    standard deviation `std` (default 1/sqrt(fan-in)). Returns the generator, for the tensors drawn after these."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)))
            elif leaf == "D" or "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 3.0)
            elif leaf == "e_score_correction_bias":
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (std or p.shape[-1] ** -0.5))
    return g


def build_miniature(cfg: dict, out: Path, vocab_size: int, tokenizer=None, layers: int | None = None,
                    seed: int = 0):
    """Writes the miniature of `cfg` to `out` (config.json in `cfg`'s form, model.safetensors with the MTP
    head's tensors where `cfg` has a head, the tokenizer beside them if given); returns transformers' model."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from ..ir.checkpoint import program_from_config

    mini = miniature_config(cfg, vocab_size, layers)
    if tokenizer is not None:
        mini |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id}
    fields = {k: v for k, v in mini.items() if k not in ("architectures", "auto_map")}
    if "time_step_limit" in mini:  # transformers' scan clamps with a float32 bound: Ultra's 1e308 overflows it
        fields["time_step_limit"] = [v if v <= FLOAT32_MAX else math.inf for v in mini["time_step_limit"]]
    hf_cfg = NemotronHConfig(**fields)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(hf_cfg).float().eval()
    seeded_init(model, seed + 1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    head = program_from_config(mini, out / "config.json").find("mtp")
    if head:
        g = torch.Generator().manual_seed(seed + 2)
        tensors = load_file(str(out / "model.safetensors"))
        for k, shape in head[0].op.params().items():
            t = torch.randn(shape, generator=g) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.1)
            tensors[f"mtp.{k}"] = (1 + t if len(shape) == 1 and k.endswith("norm.weight") else t).contiguous()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # the config as the family writes it (transformers' save rewrites the layout as lists and drops old fields)
    saved = json.loads((out / "config.json").read_text()) | _layout_of(mini)
    if not isinstance(mini.get("layers_block_type"), list):
        saved = {k: v for k, v in saved.items() if k not in ("layers_block_type", "mtp_layers_block_type")}
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return model


def _layout_of(mini: dict) -> dict:
    keys = ("hybrid_override_pattern", "layers_block_type", "mtp_hybrid_override_pattern", "mtp_layers_block_type",
            "num_nextn_predict_layers", "time_step_limit")
    return {k: mini[k] for k in keys if k in mini}


def load_config(path_or_name: str) -> dict:
    """A config by shipped name or path, with transformers' `Infinity` read as a float."""
    from .default_model import model_path

    p = model_path(path_or_name)
    p = p / "config.json" if p.is_dir() else p
    return json.loads(p.read_text(), parse_constant=lambda c: {"Infinity": math.inf, "-Infinity": -math.inf}[c])
