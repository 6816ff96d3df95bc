"""An LSTM language model: the recurrent baseline of the long-range benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

__all__ = ["LSTMConfig", "LSTMLanguageModel"]


@dataclass
class LSTMConfig:
    vocab_size: int = field(default=256, metadata={"help": "vocabulary size"})
    embed_dim: int = field(default=128, metadata={"help": "embedding width"})
    hidden_dim: int = field(default=256, metadata={"help": "LSTM state width"})
    num_layers: int = field(default=2, metadata={"help": "stacked LSTM layers"})
    dropout: float = field(default=0.0, metadata={"help": "dropout between LSTM layers"})


class LSTMLanguageModel(nn.Module):
    """``input_ids (B, T) -> logits (B, T, vocab)``, the same interface as :class:`attnkit.nn.models.GPT`."""

    def __init__(self, config: LSTMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.lstm = nn.LSTM(config.embed_dim, config.hidden_dim, config.num_layers, batch_first=True,
                            dropout=config.dropout if config.num_layers > 1 else 0.0)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(input_ids))  # (B, T, hidden_dim)
        return self.lm_head(h)  # (B, T, vocab)
