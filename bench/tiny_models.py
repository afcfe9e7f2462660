"""Small models and data shared by the tests, the golden graphs and the CLI tests."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
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


class Recurrent(nn.Module):
    """nn.LSTM or nn.GRU over a sequence, classify the last state (CPU mkldnn RNN kernels)."""

    def __init__(self, cell: str = "lstm", d_in: int = 20, hidden: int = 16, classes: int = 5):
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](d_in // 4, hidden, batch_first=True, num_layers=2)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.rnn(x.reshape(x.shape[0], 4, -1))[0][:, -1])


class Checkpointed(nn.Module):
    """Activation checkpointing (non-reentrant) around a block with dropout."""

    def __init__(self, d_in: int = 20, hidden: int = 32, classes: int = 5, reentrant: bool = False):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(d_in, hidden), nn.Dropout(0.3), nn.GELU(), nn.Linear(hidden, hidden))
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(hidden, classes))
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant))


class MaxNormEmbedding(nn.Module):
    """Embedding(max_norm=...) renormalises looked-up rows in place; optionally a frozen second table."""

    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 5, frozen_table: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, max_norm=1.0)
        self.fixed = nn.Embedding(vocab, dim, max_norm=0.5).requires_grad_(not frozen_table)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.head((self.embed(tokens) + self.fixed(tokens)).mean(1))


class DropoutBN(nn.Module):
    """Dropout and BatchNorm: what train() and eval() change."""

    def __init__(self, d_in: int = 20, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


MODELS = {
    "mlp": MLP,
    "cnn": SmallCNN,
    "tied": TiedLM,
    "lstm": lambda: Recurrent("lstm"),
    "gru": lambda: Recurrent("gru"),
    "checkpoint": Checkpointed,
    "maxnorm": MaxNormEmbedding,
    "dropout_bn": DropoutBN,
}


def make_model(name: str) -> nn.Module:
    return MODELS[name]()


def make_batch(name: str, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "cnn":
        x = torch.randn(n, 1, 8, 8, generator=generator)
    elif name in ("tied", "maxnorm"):
        x = torch.randint(0, 50, (n, 6), generator=generator)
    else:
        x = torch.randn(n, 20, generator=generator)
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


def plain_sgd_factory():
    """FACTORY for ``transpiler dump --mode dim_reduce``: DimReduce's plain SGD with lr=1, as Boost uses."""
    model, _, loss_fn, batch = tiny_factory()
    return model, torch.optim.SGD(model.parameters(), lr=1.0), loss_fn, batch


class PerParameter(torch.optim.Optimizer):
    """A user's optimizer written per parameter: ``step()`` calls ``update`` for each one with a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, self.state[p], group)

    def update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError


class Lion(PerParameter):
    """Lion (Chen et al. 2023), written as a user would: sign of an interpolated momentum, decoupled decay."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    def update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        beta1, beta2 = group["betas"]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        update = state["exp_avg"].mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
        p.add_(update, alpha=-group["lr"])
        state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Lamb(PerParameter):
    """LAMB (You et al. 2020), written as a user would: Adam's bias-corrected step plus decoupled decay, scaled
    per tensor by the trust ratio ``||p|| / ||update||`` (1 where either norm is 0)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        m_hat, v_hat = m / (1 - beta1 ** state["step"]), v / (1 - beta2 ** state["step"])
        update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
        w_norm, u_norm = p.norm(), update.norm()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        p.sub_(group["lr"] * ratio * update)


def muon_and_adamw(params) -> torch.optim.Optimizer:
    """Muon on the matrices and AdamW on the rest, as torch documents Muon, chained into one optimizer."""
    from transpiler.trace.optimizers import OptimizerChain

    params = list(params)
    matrices, rest = [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]
    return OptimizerChain([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=0.01)])


class HFLoss(nn.Module):
    """A Hugging Face causal LM whose forward returns its own loss (labels = inputs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return HFLoss(GPT2LMHeadModel(config))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return HFLoss(LlamaForCausalLM(config))
