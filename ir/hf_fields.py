"""NemotronHConfig fields (the Hugging Face `nemotron_h` config) and the op specs they describe: type and
range checks, the spec one (per-layer) config gives, and the fields a spec writes back."""
from __future__ import annotations

import math

from ..errors import CheckpointError
from .ops import MLP, Attention, Mamba2, MoE, OpSpec

#: layers_block_type spellings (old and new transformers) -> op kind
LAYER_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "M": "mamba2", "moe": "moe", "E": "moe",
               "attention": "attention", "full_attention": "attention", "*": "attention", "mlp": "mlp", "-": "mlp"}

#: Sanity bound, checked before any per-layer list is built (Nemotron-3 Super: 88 layers).
MAX_LAYERS = 10_000

_INT, _NUM, _BOOL, _STR = "a non-negative integer", "a finite number", "true or false", "a string"
_LAYOUT, _LIST, _OBJECT = "a string or a list of strings", "a list of objects", "an object"
#: JSON types of the config fields puzzlekit reads; null means "not set" (the default applies)
FIELD_TYPES = {
    **dict.fromkeys(("hidden_size", "vocab_size", "num_hidden_layers", "mamba_num_heads", "mamba_head_dim",
                     "ssm_state_size", "n_groups", "mamba_n_groups", "conv_kernel", "chunk_size", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                     "moe_latent_size", "n_shared_experts", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "num_nextn_predict_layers", "n_group", "topk_group",
                     "max_position_embeddings"), _INT),
    **dict.fromkeys(("layer_norm_epsilon", "routed_scaling_factor"), _NUM),
    **dict.fromkeys(("tie_word_embeddings", "use_conv_bias", "norm_topk_prob", "attention_bias", "mlp_bias",
                     "use_bias", "mamba_proj_bias"), _BOOL),
    **dict.fromkeys(("dtype", "torch_dtype", "mamba_hidden_act", "mlp_hidden_act"), _STR),
    **dict.fromkeys(("hybrid_override_pattern", "layers_block_type", "mtp_hybrid_override_pattern",
                     "mtp_layers_block_type"), _LAYOUT),
    "block_configs": _LIST, "mtp_block_configs": _LIST, "mtp": _OBJECT,
}
#: lower bounds beyond the JSON type: the epsilon is > 0
_BOUNDS = {"layer_norm_epsilon": (lambda v: v > 0, "> 0")}
#: the largest float32: an upper clamp of dt beyond it clamps nothing (dt is computed in float32)
FLOAT32_MAX = 3.4028234663852886e38
#: transformers' JSON spelling of an infinite float (json has none)
INFINITY = {"__float__": "Infinity"}
#: the context a config without `max_position_embeddings` gets from transformers' NemotronHConfig and SGLang's
DEFAULT_CONTEXT = 4096


def context_of(cfg: dict) -> int | None:
    """The context a checkpoint holds: its `max_position_embeddings`, else the window puzzlekit trained it on
    (`provenance.training.config.seq`, the built-in model's), else None (the engines then assume
    DEFAULT_CONTEXT, and TensorRT-LLM, which reads the field itself, does not load it)."""
    stated = cfg.get("max_position_embeddings")
    if stated is not None:
        return stated
    trained = (((cfg.get("provenance") or {}).get("training") or {}).get("config") or {}).get("seq")
    return trained if type(trained) is int and trained > 0 else None


def served_context(cfg: dict) -> int:
    """The longest context an engine serves the checkpoint at without an override variable: its
    `max_position_embeddings`, DEFAULT_CONTEXT when unset (vLLM's `_get_and_verify_max_len`, SGLang's
    `ModelConfig._derive_context_length` refuse more)."""
    stated = cfg.get("max_position_embeddings")
    return stated if type(stated) is int and stated > 0 else DEFAULT_CONTEXT


def _limit_value(v):
    if v == INFINITY:
        return math.inf
    return float(v) if type(v) in (int, float) else None


def dt_clamp(cfg: dict, src) -> tuple[float, float]:
    """dt's clamp, (low, high): `time_step_limit`, applied at both ends as transformers and vLLM apply it to
    softplus(dt + dt_bias), by default (0, inf); `time_step_min` only initialises dt_bias. dt is computed in
    float32, so an upper end beyond float32's range (Ultra's 1e308) clamps nothing and reads as inf."""
    lim = cfg.get("time_step_limit")
    if lim is None:
        return 0.0, math.inf
    lo, hi = (_limit_value(v) for v in lim) if type(lim) is list and len(lim) == 2 else (None, None)
    if lo is None or hi is None or not math.isfinite(lo) or lo < 0 or hi < lo:
        raise CheckpointError(f"{src}: config field 'time_step_limit' must be [low, high] with 0 <= low <= high, "
                              f"got {short(lim)}; fix it in the config")
    return lo, (math.inf if hi > FLOAT32_MAX else hi)


def _finite(v) -> bool:
    try:
        return type(v) in (int, float) and math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


_IS = {_INT: lambda v: type(v) is int and v >= 0, _NUM: _finite, _BOOL: lambda v: type(v) is bool,
       _STR: lambda v: type(v) is str, _LAYOUT: lambda v: type(v) in (str, list),
       _LIST: lambda v: type(v) is list, _OBJECT: lambda v: type(v) is dict}


def short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def check_fields(cfg: dict, src) -> None:
    """Every field puzzlekit reads has its JSON type and range, so no TypeError surfaces later naming nothing."""
    for k, want in FIELD_TYPES.items():
        v = cfg.get(k)
        if v is not None and not _IS[want](v):
            raise CheckpointError(f"{src}: config field {k!r} must be {want}, got {short(v)}; fix it in the config")
        if v is not None and k in _BOUNDS and not _BOUNDS[k][0](v):
            raise CheckpointError(f"{src}: config field {k!r} must be {_BOUNDS[k][1]}, got {v!r}; fix it in the config")
    dt_clamp(cfg, src)


def need(cfg: dict, key: str, src):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{src}: config field {key!r} is missing; it is required for this model")
    return cfg[key]


def spec_of(kind: str, cfg: dict, src) -> OpSpec:
    try:
        return _spec_of(kind, cfg, src)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{src}: config for the {kind} layers: {e}") from None


def _spec_of(kind: str, cfg: dict, src) -> OpSpec:
    g = lambda k: need(cfg, k, src)
    hidden, eps = g("hidden_size"), cfg.get("layer_norm_epsilon", 1e-5)
    if kind == "mamba2":
        lo, hi = dt_clamp(cfg, src)
        groups = cfg.get("mamba_n_groups")  # transformers and SGLang read this spelling first
        if groups is not None and cfg.get("n_groups") not in (None, groups):
            raise CheckpointError(f"{src}: config fields n_groups={cfg['n_groups']} and mamba_n_groups={groups} "
                                  "disagree (transformers and SGLang use mamba_n_groups); make them equal")
        return Mamba2(hidden, g("mamba_num_heads"), g("mamba_head_dim"), g("ssm_state_size"),
                      groups if groups is not None else g("n_groups"),
                      cfg.get("conv_kernel", 4), cfg.get("chunk_size", 128), cfg.get("use_conv_bias", True),
                      lo, eps, hi)
    if kind == "moe":
        return MoE(hidden, g("n_routed_experts"), g("num_experts_per_tok"), g("moe_intermediate_size"),
                   g("moe_shared_expert_intermediate_size") if cfg.get("n_shared_experts", 1) else 0,
                   cfg.get("moe_latent_size") or 0, float(cfg.get("routed_scaling_factor", 1.0)),
                   cfg.get("norm_topk_prob", True), eps)
    if kind == "attention":
        heads = g("num_attention_heads")  # 0 is reported by the op's check, not as a ZeroDivisionError
        return Attention(hidden, heads, cfg.get("num_key_value_heads") or heads,
                         cfg.get("head_dim") or hidden // max(heads, 1), eps)
    return MLP(hidden, g("intermediate_size"), eps)


def too_many_layers(src, field: str, n: int) -> CheckpointError:
    return CheckpointError(f"{src}: {field} declares {n:,} layers, more than the {MAX_LAYERS:,} puzzlekit accepts; "
                           "is the field (or the file) right?")


def kinds_of(seq, field: str, src) -> list[str]:
    if not isinstance(seq, (str, list)):
        raise CheckpointError(f"{src}: {field} must be a string or a list, got {type(seq).__name__}")
    if len(seq) > MAX_LAYERS:
        raise too_many_layers(src, field, len(seq))
    out = []
    for i, t in enumerate(seq):
        if not isinstance(t, str) or t not in LAYER_TYPES:
            known = ", ".join(f"{k!r}" for k in LAYER_TYPES)
            raise CheckpointError(f"{src}: {field} has unknown layer type {short(t)} at position {i}; known: {known}")
        out.append(LAYER_TYPES[t])
    return out


#: fields whose other values puzzlekit does not implement (biases, grouped routing, other activations)
FIXED = {"attention_bias": False, "mlp_bias": False, "use_bias": False, "mamba_proj_bias": False,
         "n_group": 1, "topk_group": 1, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"}


def check_supported(cfg: dict, src) -> None:
    for k, ok in FIXED.items():
        if k in cfg and cfg[k] is not None and cfg[k] != ok:
            raise CheckpointError(f"{src}: config {k}={cfg[k]!r} is not supported (only {ok!r}); "
                                  "convert the model or file a feature request")
    if cfg.get("n_shared_experts", 1) not in (0, 1):
        raise CheckpointError(f"{src}: n_shared_experts={cfg['n_shared_experts']} is not supported (0 or 1)")


# -- specs -> config ---------------------------------------------------------------------------------
#: op kind -> the block_type a nemotron_h config names it by (vLLM's and transformers' short spelling)
BLOCK_TYPE = {"mamba2": "mamba", "moe": "moe", "attention": "attention", "mlp": "mlp"}


def fields_of(op: OpSpec) -> dict:
    """The NemotronHConfig fields that describe a block (the inverse of `spec_of`, `hidden_size` and
    `layer_norm_epsilon` aside, which the whole model shares)."""
    if isinstance(op, Mamba2):
        # dt's clamp only where it is not the default (0, inf): the published configs carry no such field, and
        # its infinity is transformers' own JSON encoding, a dict to every reader that json.loads the file
        hi = INFINITY if op.dt_max == math.inf else op.dt_max
        clamp = {"time_step_limit": [op.dt_min, hi]} if (op.dt_min, op.dt_max) != (0.0, math.inf) else {}
        return {"mamba_num_heads": op.heads, "mamba_head_dim": op.head_dim, "ssm_state_size": op.state,
                "n_groups": op.groups, "conv_kernel": op.conv, "chunk_size": op.chunk, "use_conv_bias": op.conv_bias,
                **clamp}
    if isinstance(op, MoE):
        return {"n_routed_experts": op.experts, "num_experts_per_tok": op.top_k, "moe_intermediate_size": op.d_ff,
                "moe_shared_expert_intermediate_size": op.shared_d_ff, "moe_latent_size": op.latent or None,
                "n_shared_experts": int(op.shared_d_ff > 0), "routed_scaling_factor": op.scaling,
                "norm_topk_prob": op.norm_topk}
    if isinstance(op, Attention):
        return {"num_attention_heads": op.q_heads, "num_key_value_heads": op.kv_heads, "head_dim": op.head_dim}
    if isinstance(op, MLP):
        return {"intermediate_size": op.d_ff}
    raise ValueError(f"a {op.kind!r} block has no nemotron_h fields")
