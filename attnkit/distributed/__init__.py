"""Context parallelism: exact attention over one sequence split across ``torch.distributed`` ranks
(ring pass-KV and Ulysses all-to-all, forward and backward, gloo and NCCL), and gated linear
attention by an exchange of state summaries."""

from .attention import STRATEGIES, ContextParallelPlan, context_parallel_attention, explain_context_parallel
from .comm import TIMEOUT_ENV, ContextParallelError
from .gated import context_parallel_gated_linear_attention
from .layout import SequenceLayout

__all__ = ["context_parallel_attention", "context_parallel_gated_linear_attention", "explain_context_parallel",
           "ContextParallelPlan", "SequenceLayout", "STRATEGIES", "ContextParallelError", "TIMEOUT_ENV"]
