"""Checkpoint IO: Hugging Face `nemotron_h` (uniform, with `mtp.*`) and the published heterogeneous
`nemotron_h_puzzle` in and out (with Model Optimizer's quantization config), puzzlekit's extended form
in and out, and the first form puzzlekit wrote in.

The one place callers import checkpoint IO from; the code lives in `checkpoint_config` (configs ->
Programs), `checkpoint_read` (`load`) and `checkpoint_write` (`save`)."""
from __future__ import annotations

from .checkpoint_config import (BLOCK_KINDS, EXTENDED, EXTENDED_ARCHITECTURE, INDEX, MAX_PARAMS,
                                MAX_TENSOR_ELEMENTS, MAX_TENSORS, assemble, config_form, meta_weights,
                                program_from_config, spec_from_dict, spec_to_dict)
from .checkpoint_read import CheckpointWarning, load
from .checkpoint_write import configs, save
# the helpers, importable from here as before (tests and tools reach for some)
from .checkpoint_config import (_check_layer_count, _check_size, _hf_layers, _model_dtype,  # noqa: F401
                                _node_elements, _our_layers, _tensor_bound, _with_quantization)
from .checkpoint_read import (_cast_to_model_dtype, _checkpoint_tensors, _drop_tied_head_copy,  # noqa: F401
                              _dtype_name, _index_map, _inside, _listed_shards, _meta_only, _read_json, _shard)
from .checkpoint_write import _check_reads_back, _producer  # noqa: F401

__all__ = ["BLOCK_KINDS", "EXTENDED", "EXTENDED_ARCHITECTURE", "INDEX", "MAX_PARAMS", "MAX_TENSOR_ELEMENTS",
           "MAX_TENSORS", "CheckpointWarning", "assemble", "config_form", "configs", "load",
           "meta_weights", "program_from_config", "save", "spec_from_dict", "spec_to_dict"]
