"""Training and deployment: data, synthetic tasks, the training loop, checkpoints, DDP, int8, distillation.

Where things live: ``config`` (TrainConfig, the LR schedule), ``loop`` (the loop itself), ``modeling``
(building and loading models), ``evaluate``, ``distill``, ``deploy`` (int8), ``profiler``, ``logs``
(progress, log lines, loss curve), ``checkpoint`` (save/load, untrusted directories), ``run_dir``
(what a run writes; how files are written is :mod:`attnkit.io`), ``data``, ``tasks``, ``lstm``, ``distributed`` (the
process group), ``parallel`` (how the loop spreads a batch over processes: DDP, or context parallelism).
"""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import TrainConfig, lr_at
from .data import TextCorpus, load_corpus
from .evaluate import evaluate
from .loop import TrainingDiverged, TrainingInterrupted, train
from .lstm import LSTMConfig, LSTMLanguageModel
from .modeling import build_model, load_model
from .tasks import SyntheticTask, make_task

__all__ = ["TrainConfig", "train", "evaluate", "build_model", "load_model", "save_checkpoint", "load_checkpoint",
           "CheckpointError", "TrainingDiverged", "TrainingInterrupted", "lr_at", "TextCorpus", "load_corpus",
           "SyntheticTask", "make_task",
           "LSTMConfig", "LSTMLanguageModel"]
