"""Training: the loop every stage that trains calls (`loop`), the processes of a run (`ranks`) and the
checkpoints a killed run resumes from (`checkpoints`)."""
from .checkpoints import FileCheckpoint, ShardedCheckpoint, save_atomic
from .loop import Fit, Schedule, TrainingError, fit
from .ranks import DIST_TIMEOUT_ENV, barrier, dist_timeout, distributed, nonfinite_parameters

__all__ = ["DIST_TIMEOUT_ENV", "FileCheckpoint", "Fit", "Schedule", "ShardedCheckpoint", "TrainingError", "barrier",
           "dist_timeout", "distributed", "fit", "nonfinite_parameters", "save_atomic"]
