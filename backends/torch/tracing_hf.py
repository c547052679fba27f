"""Converters for transformers' NemotronH modules (imported by tracing when transformers is installed)."""
from __future__ import annotations

from transformers.models.nemotron_h import modeling_nemotron_h as hf

from ...errors import TraceError
from ...ir.hf_fields import dt_clamp
from ...ir.ops import MLP, Attention, Mamba2, MoE, Norm
from .trace_registry import Converted, register_module


def _mixer_spec(blk, hidden: int, eps: float):
    m = blk.mixer
    if isinstance(m, hf.NemotronHMamba2Mixer):
        lo, hi = dt_clamp({"time_step_limit": [float(v) for v in m.time_step_limit]}, "the Mamba mixer")
        return Mamba2(hidden, m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups, m.conv_kernel_size,
                      m.chunk_size, m.use_conv_bias, lo, eps, hi)
    if isinstance(m, hf.NemotronHMoE):
        g = m.gate
        if g.num_group != 1:
            raise TraceError(f"MoE routing with n_group={g.num_group} is not supported (1 only)")
        latent = m.fc1_latent_proj.out_features if hasattr(m.fc1_latent_proj, "out_features") else 0
        return MoE(hidden, m.experts.num_experts, g.top_k, m.experts.intermediate_dim,
                   m.shared_experts.intermediate_size, latent, float(g.routed_scaling_factor), bool(g.norm_topk_prob),
                   eps)
    if isinstance(m, hf.NemotronHAttention):
        return Attention(hidden, m.q_proj.out_features // m.head_dim, m.k_proj.out_features // m.head_dim,
                         m.head_dim, eps)
    if isinstance(m, hf.NemotronHMLP):
        return MLP(hidden, m.intermediate_size, eps)
    return None


def _block(blk: hf.NemotronHBlock, path: str):
    hidden, eps = blk.norm.weight.shape[0], blk.norm.variance_epsilon
    op = _mixer_spec(blk, hidden, eps)
    if op is None:
        return None
    w = {}
    for k, t in blk.state_dict().items():
        if k in ("mixer.experts.up_proj", "mixer.experts.down_proj"):  # stacked [E, out, in] -> per expert
            leaf = k.rsplit(".", 1)[1]
            w.update({f"mixer.experts.{j}.{leaf}.weight": t[j] for j in range(t.shape[0])})
        else:
            w[k] = t
    return Converted(op, w, swap=True)


register_module(hf.NemotronHBlock, _block)
register_module(hf.NemotronHRMSNorm, lambda m, p: Converted(Norm(m.weight.shape[0], m.variance_epsilon),
                                                            {"weight": m.weight.detach()}))
