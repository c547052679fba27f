"""A heterogeneous Nemotron-H model (`NemotronHPuzzleForCausalLM`) for `trust_remote_code=True`: transformers'
NemotronH modules, each layer built from its own config (`get_nemotron_h_config_for_layer`), and the
multi-token-prediction (MTP) head.

The checkpoint stores each routed expert as its own `mixer.experts.{j}.up_proj/down_proj` and the trunk under
`backbone.`, as the published checkpoints do; the MoE layers here hold their experts that way, so the weights load
as stored, with no conversion. Prefill, cached decode and `generate` are transformers' own. The MTP head is not
used by `generate`; `mtp_logits` runs it (speculative decoding is the serving engine's).

This file imports only torch and transformers: it travels with the checkpoint and runs in the loader's environment.
"""
from __future__ import annotations

from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.masking_utils import create_causal_mask
from transformers.models.nemotron_h import modeling_nemotron_h as nh

from .configuration_nemotron_h_puzzle import NemotronHPuzzleConfig

# -- Model Optimizer's FP8 and NVFP4 checkpoints, dequantised on the fly -----------------------------------------
FP8_MAX, E2M1_MAX, NVFP4_BLOCK = 448.0, 6.0, 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: E2M1 rounding: the midpoints between magnitudes, and whether a tie rounds up (to the even neighbour)
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_values(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E2M1 value, ties to even, saturating at 6."""
    mag = x.abs()
    idx = torch.zeros_like(mag, dtype=torch.long)
    for bound, up in _E2M1_MIDPOINTS:
        idx += (mag >= bound) if up else (mag > bound)
    return torch.tensor(E2M1_VALUES[:8], device=x.device)[idx] * torch.where(x < 0, -1.0, 1.0)


def _nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantise-dequantise of activations: dynamic E4M3 block scales of 16 under a static global scale."""
    s2 = global_scale.float()
    blocks = x.float().reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    sb = blocks.abs().amax(-1, keepdim=True) / (E2M1_MAX * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb).clamp(min=2.0**-9, max=FP8_MAX)
    scale = sb.to(torch.float8_e4m3fn).float() * s2
    return (_e2m1_values(blocks / scale) * scale).reshape(x.shape).to(x.dtype)


class ModelOptLinear(nn.Module):
    """A bias-free linear layer as Model Optimizer stores it: `weight` in FP8 E4M3 with a float32 `weight_scale`,
    or NVFP4 (two E2M1 values per byte, E4M3 `weight_scale` per block of 16, float32 `weight_scale_2`), and a
    static `input_scale` where activations are quantised too (FP8, NVFP4; not W4A16_NVFP4). The forward
    dequantises the weight and quantises-dequantises the input: the arithmetic the engines' kernels perform."""

    def __init__(self, in_features: int, out_features: int, algo: str):
        super().__init__()
        self.in_features, self.out_features, self.algo = in_features, out_features, algo
        if algo == "FP8":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
            self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))
        elif algo in ("NVFP4", "W4A16_NVFP4"):
            self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("weight_scale", torch.ones(out_features, in_features // NVFP4_BLOCK,
                                                            dtype=torch.float8_e4m3fn))
            self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32))
        else:
            raise ValueError(f"quantization algorithm {algo!r} is not one this model reads (FP8, NVFP4, W4A16_NVFP4)")
        self.register_buffer("input_scale", None if algo == "W4A16_NVFP4" else torch.ones((), dtype=torch.float32))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.algo == "FP8":
            return self.weight.to(dtype) * self.weight_scale.to(dtype)
        codes = torch.stack([self.weight & 0xF, self.weight >> 4], dim=-1).flatten(-2).long()
        values = torch.tensor(E2M1_VALUES, device=codes.device)[codes]
        scale = self.weight_scale.float() * self.weight_scale_2.float()
        return (values.reshape(self.out_features, -1, NVFP4_BLOCK) * scale[..., None]).reshape(
            self.out_features, self.in_features).to(dtype)

    def quantize_input(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        scale = self.input_scale if scale is None else scale
        if scale is None:
            return x
        if self.algo == "FP8":
            s = scale.to(x.dtype)
            return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s
        return _nvfp4_qdq(x, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantize_input(x), self.dequantized(x.dtype))


def _module_algos(model: nn.Module, qc: dict) -> dict[str, str]:
    """Linear module -> Model Optimizer algorithm, from config.json's `quantization_config`: one `quant_algo` for
    every linear module outside `ignore`, or MIXED_PRECISION's `quantized_layers` (a module not listed is not
    quantised)."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if qc.get("quant_algo") == "MIXED_PRECISION":
        layers = qc.get("quantized_layers") or {}
        return {n: layers[n]["quant_algo"] for n in linears if n in layers}
    ignore = qc.get("ignore") or qc.get("exclude_modules") or []
    return {n: qc["quant_algo"] for n in linears if not any(fnmatch(n, p) for p in ignore)}


def use_modelopt_linears(model: nn.Module, qc: dict | None) -> None:
    """Replaces the linear modules a Model Optimizer quantization config names by `ModelOptLinear`s."""
    if not qc or qc.get("quant_method") != "modelopt":
        return
    for name, algo in _module_algos(model, qc).items():
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        if old.bias is not None:
            raise ValueError(f"{name}: a quantised linear layer with a bias is not supported")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                ModelOptLinear(old.in_features, old.out_features, algo))


class NemotronHPuzzleExpert(nn.Module):
    """One routed expert: up, squared ReLU, down (no gate), on the hidden or the latent width."""

    def __init__(self, config):
        super().__init__()
        width = config.moe_latent_size or config.hidden_size
        self.up_proj = nn.Linear(width, config.moe_intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.moe_intermediate_size, width, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.mlp_hidden_act]

    def forward(self, x, up_scale=None, down_scale=None):
        """`up_scale`, `down_scale`: the layer's shared input scales, used instead of each expert's own."""
        return _linear(self.down_proj, self.act_fn(_linear(self.up_proj, x, up_scale)), down_scale)


def _linear(layer: nn.Module, x: torch.Tensor, input_scale=None) -> torch.Tensor:
    if isinstance(layer, ModelOptLinear):
        return F.linear(layer.quantize_input(x, input_scale), layer.dequantized(x.dtype))
    return layer(x)


class NemotronHPuzzleExperts(nn.ModuleList):
    """The routed experts as stored; each runs over the tokens routed to it only."""

    def __init__(self, config):
        super().__init__(NemotronHPuzzleExpert(config) for _ in range(config.n_routed_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        order = top_k_index.reshape(-1).argsort(stable=True)
        counts = torch.bincount(top_k_index.reshape(-1), minlength=len(self)).tolist()
        up, down = self._input_scales()
        for e, rows in zip(range(len(self)), order.split(counts)):
            if rows.numel():
                tokens = rows // k
                y = self[e](hidden_states[tokens], up, down) * top_k_weights.reshape(-1)[rows, None]
                out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _input_scales(self):
        """Quantised experts share one input scale per side, the largest of the layer's (the engines' fused MoE
        kernels take one per layer)."""
        def largest(side):
            scales = [getattr(getattr(e, side), "input_scale", None) for e in self]
            return None if scales[0] is None else torch.stack(scales).amax()
        return largest("up_proj"), largest("down_proj")


class NemotronHPuzzleMoE(nh.NemotronHMoE):
    """transformers' NemotronH MoE (router, shared expert, latent projections, forward) with the experts as stored."""

    def __init__(self, config, layer_idx=None):
        nn.Module.__init__(self)
        self.config = config
        self.experts = NemotronHPuzzleExperts(config)
        self.gate = nh.NemotronHTopkRouter(config)
        self.shared_experts = nh.NemotronHMLP(config=config,
                                              intermediate_size=config.moe_shared_expert_intermediate_size)
        latent = config.moe_latent_size
        self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=config.mlp_bias) if latent else nn.Identity()
        self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=config.mlp_bias) if latent else nn.Identity()


class NemotronHPuzzleBlock(nh.NemotronHBlock):
    """transformers' NemotronH block, built from this layer's own config."""

    def __init__(self, config, layer_idx):
        super(nh.NemotronHBlock, self).__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.norm = nh.NemotronHRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.block_type = config.layers_block_type[layer_idx]
        mixer = NemotronHPuzzleMoE if self.block_type == "moe" else nh.MIXER_TYPES[self.block_type]
        self.mixer = mixer(config, layer_idx=layer_idx)


class NemotronHPuzzlePreTrainedModel(nh.NemotronHPreTrainedModel):
    config: NemotronHPuzzleConfig
    config_class = NemotronHPuzzleConfig
    base_model_prefix = "backbone"
    _no_split_modules = ["NemotronHPuzzleBlock"]
    _keys_to_ignore_on_load_unexpected = None  # the MTP head's tensors load into `mtp`


class NemotronHPuzzleModel(NemotronHPuzzlePreTrainedModel, nh.NemotronHModel):
    """transformers' NemotronH trunk (its forward, caches and masks), each layer from its own config."""

    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"^lm_head\."]  # the causal LM's, loaded as AutoModel

    def __init__(self, config: NemotronHPuzzleConfig):
        NemotronHPuzzlePreTrainedModel.__init__(self, config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHPuzzleBlock(config.get_nemotron_h_config_for_layer(i), layer_idx=i)
                                    for i in range(len(config.layers_block_type)))
        self.norm_f = nh.NemotronHRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_init()


class NemotronHPuzzleMTP(nn.Module):
    """The MTP head: position t fuses the embedding of token t with the trunk's hidden state at t-1 (before the
    final norm), `eh_proj(cat(enorm(embed(x_t)), hnorm(h_{t-1})))`, runs its own blocks, then `final_layernorm`;
    the trunk's LM head turns that into logits for token t+1."""

    def __init__(self, config: NemotronHPuzzleConfig):
        super().__init__()
        self.config = config.get_mtp_config()
        h, eps = config.hidden_size, config.layer_norm_epsilon
        self.layers = nn.ModuleList(NemotronHPuzzleBlock(config.get_mtp_config_for_layer(i), layer_idx=i)
                                    for i in range(len(config.mtp_block_configs)))
        first, last = self.layers[0], self.layers[-1]
        first.enorm = nh.NemotronHRMSNorm(h, eps=eps)
        first.hnorm = nh.NemotronHRMSNorm(h, eps=eps)
        first.eh_proj = nn.Linear(2 * h, h, bias=False)
        last.final_layernorm = nh.NemotronHRMSNorm(h, eps=eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """embeds: the trunk's embeddings of the tokens; hidden: the trunk's last layer output (before its final
        norm). Returns the head's output after its final norm."""
        first = self.layers[0]
        prev = torch.cat([hidden.new_zeros(hidden.shape[0], 1, hidden.shape[2]), hidden[:, :-1]], dim=1)
        z = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(prev)], dim=-1))
        positions = torch.arange(z.shape[1], device=z.device)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=z, attention_mask=attention_mask, cache=None,
                                  position_ids=positions)
        for layer in self.layers:
            z = layer(z, attention_mask=mask if layer.block_type == "full_attention" else None,
                      position_ids=positions)
        return self.layers[-1].final_layernorm(z)


class NemotronHPuzzleForCausalLM(NemotronHPuzzlePreTrainedModel, nh.NemotronHForCausalLM):
    """transformers' NemotronH causal LM (forward, generation) over the heterogeneous trunk, with the MTP head."""

    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: NemotronHPuzzleConfig):
        NemotronHPuzzlePreTrainedModel.__init__(self, config)
        self.backbone = NemotronHPuzzleModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = NemotronHPuzzleMTP(config) if config.num_nextn_predict_layers and config.mtp_block_configs \
            else None
        use_modelopt_linears(self, getattr(config, "quantization_config", None))
        self.post_init()

    @property
    def model(self) -> NemotronHPuzzleModel:
        """transformers' NemotronH names its trunk `model`; the checkpoint (and this class) `backbone`."""
        return self.backbone

    def mtp_logits(self, input_ids: torch.LongTensor, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(trunk logits, MTP logits) of every position of a fresh sequence. The MTP logits at t predict token t+1
        from the trunk's state at t-1 and token t: the token after next, seen from that state."""
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP head (num_nextn_predict_layers is 0)")
        before_norm = []  # the trunk's last layer output: the input of its final norm
        hook = self.backbone.norm_f.register_forward_pre_hook(lambda module, args: before_norm.append(args[0]))
        try:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            hook.remove()
        z = self.mtp(self.backbone.embeddings(input_ids), before_norm[0], attention_mask)
        return self.lm_head(out.last_hidden_state).float(), self.lm_head(z).float()


__all__ = ["NemotronHPuzzleForCausalLM", "NemotronHPuzzleModel", "NemotronHPuzzlePreTrainedModel"]
