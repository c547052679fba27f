"""TensorRT engine bundles per target and scenario; engines built here with TensorRT-RTX where installed.

Nothing here imports TensorRT: the bundle's build_engines.py does, in its own process."""
from .bundle import BundleError, BundleReport, check_fp4, formats, plan_profiles, precision, write_bundle

__all__ = ["BundleError", "BundleReport", "check_fp4", "formats", "plan_profiles", "precision", "write_bundle"]
