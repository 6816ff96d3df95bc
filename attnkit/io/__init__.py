"""Files, below every other layer: atomic, symlink-safe writes (``files``), the safetensors weight
format and its header checks (``weights``), and the on-disk layout of a training run (``checkpoints``).
Nothing here imports the rest of attnkit."""

from .files import append_line, atomic_write, atomic_write_text, read_json, remove_stale_temporaries
from .weights import CheckpointError, check_finite_weights, model_from_header, read_header, read_safetensors

__all__ = ["CheckpointError", "append_line", "atomic_write", "atomic_write_text", "check_finite_weights",
           "model_from_header", "read_header", "read_json", "read_safetensors", "remove_stale_temporaries"]
