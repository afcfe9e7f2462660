"""Eager reference training and comparisons shared by single-process tests."""

from __future__ import annotations

import copy

import torch


def eager_twin(model: torch.nn.Module, make_opt):
    twin = copy.deepcopy(model)
    return twin, make_opt(twin)


def eager_step(model, optimizer, loss_fn, batch) -> torch.Tensor:
    optimizer.zero_grad()
    loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()


def assert_same_training_state(model_a, opt_a, model_b, opt_b) -> None:
    """Bitwise: parameters, buffers and every optimizer-state tensor."""
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs"
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert set(sa) == set(sb), f"state keys differ: {set(sa)} vs {set(sb)}"
        for key in sb:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), f"optimizer state {key} differs"
