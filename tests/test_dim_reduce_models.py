"""DimReduce on models we did not write for it, against an eager PyTorch DimReduce written here.

The eager reference takes the published formulas (see tests/test_dim_reduce.py) for any model: the
gradient from ``loss.backward()``, the trial losses from ``torch.func.functional_call`` at the trial
weights with copies of the buffers (so, as in the transpiled step, only the main forward updates
BatchNorm's running statistics), the algebra in float64. The models: an LSTM, whose ``bias_ih`` and
``bias_hh`` get the very same gradient tensor from autograd; a CNN with BatchNorm; a language model with
tied embeddings; Hugging Face GPT-2 (random init, dropout off) returning its own loss. Dropout is left
out: each trial forward draws new masks, and so would the eager one, but in another order.
Tolerance: 1e-5 on the weights and buffers after 3 steps (float32 model, float64 algebra; the buffers
follow the weights), and the same line-search decisions. Measured: 1.5e-8 (LSTM), 3.0e-8 (CNN),
2.4e-7 (tied LM), 1.2e-7 (GPT-2). Before this test, each trial forward also
updated BatchNorm's running statistics: three updates per step instead of one.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from bench.tiny_models import make_batch, make_model
from transpiler import DimReduce, transpile
from transpiler.graph.basis import layout

ATOL = 1e-6  # float32 against the eager float32 reference in another order: 1.5e-8 to 2.4e-7 measured


def random_basis(model: nn.Module, path, components: int = 6):
    names, shapes = layout(model)
    n = sum(math.prod(s) for s in shapes)
    q, _ = torch.linalg.qr(torch.randn(n, components, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    torch.save({"pca_mat": q.T.float().contiguous(), "names": names, "shapes": shapes}, path)
    return q.T.float()


def loss_of(model, params, batch, loss_fn):
    inputs = batch[:-1] if loss_fn is not None else batch
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    out = functional_call(model, {**params, **buffers}, inputs)
    return loss_fn(out, batch[-1]) if loss_fn is not None else out


def eager_dim_reduce(model, rows, batches, loss_fn, *, rho=0.55, gamma=0.9, alpha=0.001, sigma=0.4):
    """Weights after each step and the chosen rho, from the published formulas."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for _, p in named]
    p_mat = rows.double()
    k, n = p_mat.shape
    bk, started, m = torch.eye(k, dtype=torch.float64), False, 0
    gk_last, sk = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)

    def unflat(flat):
        return {name: part.view_as(p).float() for (name, p), part in zip(named, flat.split(sizes))}

    rhos = []
    for batch in batches:
        model.zero_grad()
        loss = loss_of(model, dict(model.named_parameters()), batch, loss_fn)  # buffers: see loss_of
        if loss_fn is not None:  # the main forward updates BatchNorm statistics, as the step does
            model(*batch[:-1])
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for _, p in named]).double()
        w = torch.cat([p.detach().reshape(-1) for _, p in named]).double()
        old = loss.item()
        gk = p_mat @ g
        new_bk = bk
        if started:
            yk = gk - gk_last
            c = float(yk @ sk)
            if c > 1e-20:
                t1 = torch.eye(k, dtype=torch.float64) - torch.outer(yk, sk) / c
                new_bk = t1.T @ bk @ t1 + torch.outer(sk, sk) / c
        started = True
        dk = -new_bk @ gk
        dn, proj = p_mat.T @ dk, p_mat.T @ gk
        chosen = 0.0
        with torch.no_grad():
            for r in (1.0, rho):
                if loss_of(model, unflat(w + r * dn), batch, loss_fn).item() < old + sigma * r * float(gk @ dk):
                    chosen = r
                    break
        if chosen:
            sk, bk, gk_last = chosen * dk, new_bk, gk
        m = gamma * m + g - proj
        new = unflat(w - (alpha * m - chosen * dn))
        with torch.no_grad():
            for name, p in named:
                p.copy_(new[name])
        rhos.append(chosen)
    return rhos


def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.GPT2LMHeadModel(config)

        def forward(self, ids):
            return self.lm(input_ids=ids, labels=ids).loss

    gen = torch.Generator().manual_seed(2)
    return LM(), [(torch.randint(0, 64, (2, 16), generator=gen),) for _ in range(3)], None


def ours(name):
    torch.manual_seed(0)
    model = make_model(name)
    gen = torch.Generator().manual_seed(3)
    return model, [make_batch(name, 8, gen) for _ in range(3)], nn.CrossEntropyLoss()


@pytest.mark.parametrize("name", ["lstm", "cnn", "tied", "gpt2"])
def test_dim_reduce_matches_an_eager_reference_on_other_models(name, tmp_path):
    model, batches, loss_fn = gpt2() if name == "gpt2" else ours(name)
    reference_model = copy.deepcopy(model)
    rows = random_basis(model, tmp_path / "basis.pt")
    step = transpile(
        model, torch.optim.SGD(model.parameters(), lr=1.0), DimReduce(pca_path=str(tmp_path / "basis.pt")), loss_fn
    )
    seen = []
    for batch in batches:
        step(*batch)
        seen.append(step.last_metrics["rho"])
    expected = eager_dim_reduce(reference_model, rows, batches, loss_fn)
    assert seen == pytest.approx(expected)
    for (name_a, a), (_, b) in zip(model.named_parameters(), reference_model.named_parameters()):
        assert (a - b).abs().max() <= ATOL, name_a
    for (name_a, a), (_, b) in zip(model.named_buffers(), reference_model.named_buffers()):  # updated once per step
        assert (a.double() - b.double()).abs().max() <= ATOL, name_a
