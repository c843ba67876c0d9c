"""The training loop, checkpoints, monitoring."""

from tierlm.train.run import run_training
from tierlm.train.trainer import Trainer, TrainResult

__all__ = ["Trainer", "TrainResult", "run_training"]
