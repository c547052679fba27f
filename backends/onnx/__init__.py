"""ONNX lowering (prefill and decode graphs), onnxruntime execution and the TensorRT lint."""
from .export import DECODE, PREFILL, ExportError, ExportReport, export_onnx
from .lint import Finding, lint
from .runtime import OnnxModel

__all__ = ["DECODE", "PREFILL", "ExportError", "ExportReport", "Finding", "OnnxModel", "export_onnx", "lint"]
