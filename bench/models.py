"""Benchmark models: an MLP of about 5M parameters and a small transformer."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def mlp_5m() -> tuple[nn.Module, tuple[int, ...], int]:
    model = nn.Sequential(
        nn.Linear(1024, 2048),
        nn.ReLU(),
        nn.Linear(2048, 1024),
        nn.ReLU(),
        nn.Linear(1024, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )
    return model, (1024,), 10


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 2000, dim: int = 128, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos).mean(1))


def batch_for(name: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "mlp_5m":
        return torch.randn(n, 1024, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    return torch.randint(0, 2000, (n, 32), generator=gen), torch.randint(0, 10, (n,), generator=gen)


def build(name: str) -> nn.Module:
    return mlp_5m()[0] if name == "mlp_5m" else TinyTransformer()


def start_rank(name: str, per_rank: int) -> tuple[int, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Under torchrun: join the gloo group, one intra-op thread, and build the model (the same weights on every
    rank) and this rank's batch. Returns the rank, the model and the batch."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(name)
    return rank, model, batch_for(name, per_rank, torch.Generator().manual_seed(rank))
