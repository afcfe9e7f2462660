"""Small models and data shared by the tests, the golden graphs and the CLI tests."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 20, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv + BatchNorm: exercises buffers (running statistics) in the graph."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, bias=False)  # a bias before BatchNorm has a zero gradient
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, classes)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight: one gradient, reduced once."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab)
        self.proj.weight = self.embed.weight
        self.frozen_scale = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, tokens):
        return self.proj(torch.tanh(self.embed(tokens).mean(1) * self.frozen_scale))


def make_model(name: str) -> nn.Module:
    return {"mlp": MLP, "cnn": SmallCNN, "tied": TiedLM}[name]()


def make_batch(name: str, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "mlp":
        x = torch.randn(n, 20, generator=generator)
    elif name == "cnn":
        x = torch.randn(n, 1, 8, 8, generator=generator)
    else:
        x = torch.randint(0, 50, (n, 6), generator=generator)
    classes = 50 if name == "tied" else 5
    return x, torch.randint(0, classes, (n,), generator=generator)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def tiny_factory():
    """FACTORY for the CLI: (model, optimizer, loss_fn, example_batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, nn.CrossEntropyLoss(), (torch.randn(6, 4), torch.randint(0, 3, (6,)))
