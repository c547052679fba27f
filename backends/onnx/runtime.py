"""onnxruntime execution of an export: prefill, then decode steps with the state kept in ORT's own buffers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .export import DECODE, PREFILL


class OnnxModel:
    """Runs prefill.onnx and decode.onnx from an export directory; `generate` decodes greedily."""

    def __init__(self, directory, threads: int | None = None):
        directory = Path(directory)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        self.prefill_session = ort.InferenceSession(str(directory / PREFILL), opts, providers=["CPUExecutionProvider"])
        self.decode_session = ort.InferenceSession(str(directory / DECODE), opts, providers=["CPUExecutionProvider"])
        meta = self.prefill_session.get_modelmeta().custom_metadata_map
        self.state_names = json.loads(meta["puzzlekit.state_names"])
        self.output_names = json.loads(meta["puzzlekit.outputs"])

    def prefill(self, input_ids: np.ndarray):
        """-> ({output name: array}, state as OrtValues)."""
        binding = self.prefill_session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        return self._run(self.prefill_session, binding)

    def decode(self, token_ids: np.ndarray, state: list):
        """One token per sequence; `state` as returned by prefill/decode (OrtValues or arrays)."""
        binding = self.decode_session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(np.reshape(token_ids, (-1, 1)), dtype=np.int64))
        for name, value in zip(self.state_names, state):
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(f"past.{name}", value)
            else:
                binding.bind_cpu_input(f"past.{name}", np.ascontiguousarray(value))
        return self._run(self.decode_session, binding)

    def _run(self, session, binding):
        for o in session.get_outputs():
            binding.bind_output(o.name)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()
        n = len(self.output_names)
        outs = {name: values[i].numpy() for i, name in enumerate(self.output_names)}
        return outs, values[n:]

    def generate(self, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """Greedy continuation of prompt [batch, length] -> [batch, length + max_new_tokens]."""
        outs, state = self.prefill(prompt)
        tokens = [outs["logits"][:, -1].argmax(-1)]
        for _ in range(max_new_tokens - 1):
            outs, state = self.decode(tokens[-1], state)
            tokens.append(outs["logits"][:, -1].argmax(-1))
        return np.concatenate([prompt, np.stack(tokens, axis=1)], axis=1)
