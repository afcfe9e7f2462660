"""Models for the memory-budget tests (tests/test_recompute.py, tests/recompute_worker.py): a small GPT whose
blocks draw dropout masks, so a recomputed random op would change the step, and a residual CNN with BatchNorm."""

from __future__ import annotations

import torch
from torch import nn

from bench.models import NarrowBlock, NarrowResNet


class DroppingGPT(nn.Module):
    """Four pre-norm GPT blocks (``bench/models.py``) with dropout between them and on the embeddings."""

    def __init__(self, blocks: int = 4, dim: int = 32, heads: int = 2, vocab: int = 64, seq: int = 32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(NarrowBlock(dim, heads) for _ in range(blocks))
        self.drop = nn.Dropout(0.1)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens) + self.pos)
        for block in self.blocks:
            x = self.drop(block(x))
        return self.head(self.norm(x)).flatten(0, 1)


def gpt_batch(n: int, seed: int, vocab: int = 64, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()


def cnn_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 12, 12, generator=gen), torch.randint(0, 10, (n,), generator=gen)


MODELS = {"gpt": (DroppingGPT, gpt_batch), "cnn": (lambda: NarrowResNet(blocks=4, channels=8), cnn_batch)}
