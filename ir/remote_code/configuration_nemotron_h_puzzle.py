"""Configuration of a heterogeneous Nemotron-H checkpoint (`model_type: nemotron_h_puzzle`), loaded with
`trust_remote_code=True` by transformers and by serving engines that build their layers from it.

The top level is an ordinary Nemotron-H config. `block_configs` holds one object per trunk layer and
`mtp_block_configs` one per layer of the multi-token-prediction head: a `block_type` (mamba, moe, attention,
mlp) and the Nemotron-H fields that differ for that layer. A layer's config is the top level with its block's
fields overlaid (`get_nemotron_h_config_for_layer`); the MTP head's is the top level with every MTP block's
fields overlaid and the head's own layer types (`get_mtp_config`).

This file imports only transformers: it travels with the checkpoint and runs in the loader's environment.
"""
from __future__ import annotations

import copy

try:  # transformers with Nemotron-H: per-layer configs are the class its NemotronH modules take
    from transformers import NemotronHConfig as _NemotronHConfig
except ImportError:  # older transformers: the same fields on a plain config
    from transformers import PretrainedConfig as _NemotronHConfig

#: fields of the puzzle form that a per-layer (plain Nemotron-H) config does not carry
_PUZZLE_ONLY = ("block_configs", "mtp_block_configs", "auto_map", "architectures", "model_type", "quantization_config")
_LAYER_TYPE = {"mamba": "linear_attention", "linear_attention": "linear_attention", "attention": "full_attention",
               "full_attention": "full_attention", "moe": "moe", "mlp": "mlp"}


class NemotronHPuzzleConfig(_NemotronHConfig):
    """A Nemotron-H config whose layers differ: `block_configs` (trunk) and `mtp_block_configs` (MTP head)."""

    model_type = "nemotron_h_puzzle"

    def __init__(self, block_configs=None, mtp_block_configs=None, **kwargs):
        self.block_configs = [dict(b) for b in block_configs or []]
        self.mtp_block_configs = [dict(b) for b in mtp_block_configs or []]
        for field, rows in (("block_configs", self.block_configs), ("mtp_block_configs", self.mtp_block_configs)):
            for i, b in enumerate(rows):
                if b.get("block_type") not in _LAYER_TYPE:
                    raise ValueError(f"{field}[{i}] has block_type {b.get('block_type')!r}; expected one of "
                                     f"{sorted(_LAYER_TYPE)}")
        if self.block_configs and "layers_block_type" not in kwargs and "hybrid_override_pattern" not in kwargs:
            kwargs["layers_block_type"] = [_LAYER_TYPE[b["block_type"]] for b in self.block_configs]
        super().__init__(**kwargs)
        if self.block_configs and len(self.block_configs) != len(self.layers_block_type):
            raise ValueError(f"block_configs has {len(self.block_configs)} entries for "
                             f"{len(self.layers_block_type)} layers; give one per layer")
        declared = [_LAYER_TYPE.get(t, t) for t in self.layers_block_type]
        stated = [_LAYER_TYPE[b["block_type"]] for b in self.block_configs]
        wrong = next((i for i, (a, b) in enumerate(zip(declared, stated)) if a != b), None)
        if wrong is not None:  # as puzzlekit's reader refuses it: the engines would build one, the weights the other
            raise ValueError(f"layer {wrong} is {self.layers_block_type[wrong]!r} in layers_block_type but "
                             f"{self.block_configs[wrong]['block_type']!r} in block_configs; make them agree")

    def _overlaid(self, blocks: list[dict], **extra) -> _NemotronHConfig:
        base = {k: v for k, v in self.to_dict().items() if k not in _PUZZLE_ONLY}
        for b in blocks:  # a null field is set too: a block without a latent has none, whatever the top level says
            base.update({k: copy.deepcopy(v) for k, v in b.items() if k != "block_type"})
        layer = _NemotronHConfig.from_dict({**base, **extra})
        impl = getattr(self, "_attn_implementation_internal", None)
        if impl is not None:  # the attention implementation the model was loaded with, not the default
            layer._attn_implementation_internal = impl
        return layer

    def get_nemotron_h_config_for_layer(self, layer_idx: int) -> _NemotronHConfig:
        """The Nemotron-H config of layer `layer_idx`: the top level with that block's fields overlaid. Past the
        trunk, `num_hidden_layers + j` is layer j of the MTP head (vLLM numbers the head's layers so)."""
        if not self.block_configs:
            return self._overlaid([])
        n = len(self.block_configs)
        if layer_idx >= n:
            return self._overlaid([self.mtp_block_configs[layer_idx - n]])
        return self._overlaid([self.block_configs[layer_idx]])

    @property
    def mtp_n_routed_experts(self) -> int | None:
        """The experts of the MTP head's MoE layer (vLLM sizes the head's expert weights by it)."""
        return next((b.get("n_routed_experts") for b in self.mtp_block_configs if b["block_type"] == "moe"), None)

    def get_mtp_config(self) -> _NemotronHConfig:
        """The Nemotron-H config of the MTP head: the top level with its blocks' fields overlaid (the head holds one
        block of each kind) and the head's layer types as its layers."""
        types = [_LAYER_TYPE[b["block_type"]] for b in self.mtp_block_configs] or list(self.mtp_layers_block_type)
        return self._overlaid(self.mtp_block_configs, layers_block_type=types)

    def get_mtp_config_for_layer(self, layer_idx: int) -> _NemotronHConfig:
        """The Nemotron-H config of MTP layer `layer_idx`: the top level with that block's fields overlaid."""
        types = [_LAYER_TYPE[b["block_type"]] for b in self.mtp_block_configs]
        return self._overlaid([self.mtp_block_configs[layer_idx]], layers_block_type=types)


__all__ = ["NemotronHPuzzleConfig"]
