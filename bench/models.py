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


class NarrowBlock(nn.Module):
    """A pre-norm GPT block: causal self-attention and a 4x MLP, each with its LayerNorm and biases."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2, self.fc, self.out = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class NarrowGPT(nn.Module):
    """A 12-block GPT of width 16 (about 40k parameters in 149 tensors): narrow enough that a step's time is the
    host's (dispatching ops), not the arithmetic's. Returns logits flattened to (batch * seq, vocab)."""

    def __init__(self, blocks: int = 12, dim: int = 16, heads: int = 2, vocab: int = 64, seq: int = 16):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.Sequential(*(NarrowBlock(dim, heads) for _ in range(blocks)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.pos))).flatten(0, 1)


class NarrowGPTStage(nn.Module):
    """Stage ``stage`` of ``stages`` of a :class:`NarrowGPT` for ``torch.distributed.pipelining``'s
    ``PipelineStage``: the same modules (not copies) as the whole model, its blocks cut into equal runs, the
    embedding in the first stage and the head in the last."""

    def __init__(self, model: NarrowGPT, stage: int, stages: int) -> None:
        super().__init__()
        per = len(model.blocks) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed, self.pos = (model.embed, model.pos) if self.first else (None, None)
        self.blocks = nn.ModuleDict({str(b): model.blocks[b] for b in range(stage * per, (stage + 1) * per)})
        self.norm, self.head = (model.norm, model.head) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.pos
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)).flatten(0, 1) if self.last else x


def pipelining_step(schedule, stage: int, stages: int, batch: tuple, microbatches: int) -> float | None:
    """One step of ``torch.distributed.pipelining``'s ``schedule`` on stage ``stage``: the first stage feeds the
    inputs, the last the targets; the last returns the mean of its microbatches' losses, the others None."""
    inputs, targets = batch
    if stage == 0:
        schedule.step(inputs)
    elif stage == stages - 1:
        losses: list[torch.Tensor] = []
        schedule.step(target=targets, losses=losses)
        return (sum(losses[1:], losses[0]) / microbatches).item()
    else:
        schedule.step()
    return None


class NarrowResidual(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input, then ReLU (ResNet's basic block, no bias before BatchNorm)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class NarrowResNet(nn.Module):
    """16 residual blocks of 8 channels with BatchNorm (about 19k parameters in 101 tensors) on 8x8 images."""

    def __init__(self, blocks: int = 16, channels: int = 8, classes: int = 10):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*(NarrowResidual(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.bn(self.stem(images)))).mean((2, 3)))


class WideResidual(nn.Module):
    """A residual MLP block of width 16 and inner width ``width``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, width), nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class UnevenMLP(nn.Module):
    """Four residual blocks, the first two ``width / 16`` times as wide inside as the others: cut into equal block
    counts, two stages are as uneven as they can be (a pipeline's balanced split, ``bench/pipeline_split.py``)."""

    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.blocks = nn.Sequential(WideResidual(width), WideResidual(width), WideResidual(16), WideResidual(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def narrow_batch(name: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``n`` samples for :data:`NARROW` model ``name``: GPT tokens and next tokens, or 8x8 images."""
    if name == "gpt":
        tokens = torch.randint(0, 64, (n, 17), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()
    return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


NARROW = {"gpt": NarrowGPT, "cnn": NarrowResNet}


def narrow_gpt_factory() -> tuple:
    """FACTORY for the CLI: the narrow GPT with AdamW, ``transpiler dump bench/models.py:narrow_gpt_factory``."""
    torch.manual_seed(0)
    model = NarrowGPT()
    return (
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        nn.CrossEntropyLoss(),
        narrow_batch("gpt", 4, torch.Generator().manual_seed(0)),
    )


class LlamaAttention(nn.Module):
    """Causal self-attention with separate ``wq``/``wk``/``wv``/``wo`` (no bias), as Llama's: a tensor-parallel plan
    splits the heads by splitting the three input projections' rows, so the head count is read from the shard."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), LlamaAttention(dim, heads)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """A Llama-style decoder (RMSNorm, multi-head attention, SwiGLU; no position encoding, which causal attention
    learns without) with torchtitan's module names, so its tensor-parallel plan (:func:`llama_tp_plan`) reads as
    torchtitan's. Returns logits (batch, seq, vocab)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, blocks: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, hidden) for _ in range(blocks))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class TinyLlamaStage(nn.Module):
    """Stage ``stage`` of ``stages`` of a :class:`TinyLlama` for ``torch.distributed.pipelining``'s
    ``PipelineStage`` (as :class:`NarrowGPTStage`): the same modules, its layers cut into equal runs, the embedding
    in the first stage, the norm and output layer in the last."""

    def __init__(self, model: TinyLlama, stage: int, stages: int) -> None:
        super().__init__()
        per = len(model.layers) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.tok_embeddings = model.tok_embeddings if self.first else None
        self.layers = nn.ModuleDict({str(b): model.layers[b] for b in range(stage * per, (stage + 1) * per)})
        self.norm, self.output = (model.norm, model.output) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x)) if self.last else x


def llama_tp_plan(model: TinyLlama, sequence_parallel: bool) -> dict:
    """torchtitan's tensor-parallel plan for a Llama block, by module name: ``wq``/``wk``/``wv`` and ``w1``/``w3``
    split by columns (heads, hidden units), ``wo`` and ``w2`` by rows, the embedding table by rows (vocabulary),
    the output layer by columns. With ``sequence_parallel`` the norms run on this rank's part of the sequence
    (``SequenceParallel``) and the activations between blocks stay split along it; without, the norms are plain
    replicated parameters."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    rows = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan: dict = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), **rows),
        "output": ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Replicate()
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        block = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(**rows),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(**rows),
        }
        if sequence_parallel:
            block["attention_norm"] = SequenceParallel()
            block["ffn_norm"] = SequenceParallel()
            block["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            block["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({f"layers.{i}.{k}": v for k, v in block.items()})
    return plan


def llama_factory() -> tuple:
    """FACTORY for the CLI: a TinyLlama with AdamW and a next-token loss (``transpiler plan
    bench/models.py:llama_factory --tp-plan bench/models.py:llama_sequence_parallel_plan``)."""
    torch.manual_seed(0)
    model = TinyLlama()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), next_token_loss, (tokens, tokens)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a language model's logits (batch, seq, vocab) against tokens (batch, seq)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def llama_sequence_parallel_plan(model: TinyLlama) -> dict:
    """``--tp-plan`` for the CLI: torchtitan's plan with sequence parallelism (:func:`llama_tp_plan`)."""
    return llama_tp_plan(model, sequence_parallel=True)
