"""Training: the loop every stage that trains calls (`loop`), the processes of a run (`ranks`), the
checkpoints a killed run resumes from (`checkpoints`) and the optimizers whose state fits (`optimizers`)."""
from .checkpoints import FileCheckpoint, ShardedCheckpoint, save_atomic
from .loop import Fit, Schedule, TrainingError, fit
from .optimizers import StochasticAdamW, state_bytes
from .ranks import DIST_TIMEOUT_ENV, barrier, dist_timeout, distributed, nonfinite_parameters

__all__ = ["DIST_TIMEOUT_ENV", "FileCheckpoint", "Fit", "Schedule", "ShardedCheckpoint", "StochasticAdamW",
           "TrainingError", "barrier", "dist_timeout", "distributed", "fit", "nonfinite_parameters", "save_atomic",
           "state_bytes"]
