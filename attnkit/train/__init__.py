"""Training and deployment: data, synthetic tasks, the training loop, checkpoints, DDP, int8, distillation."""

from .checkpoint import load_checkpoint, save_checkpoint
from .data import TextCorpus, load_corpus
from .loop import TrainConfig, build_model, evaluate, load_model, train
from .lstm import LSTMConfig, LSTMLanguageModel
from .tasks import SyntheticTask, make_task

__all__ = ["TrainConfig", "train", "evaluate", "build_model", "load_model", "save_checkpoint", "load_checkpoint",
           "TextCorpus", "load_corpus", "SyntheticTask", "make_task", "LSTMConfig", "LSTMLanguageModel"]
