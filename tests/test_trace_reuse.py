"""A step traced once serves several ``transpile(..., trace=...)`` calls: the programs built from it are those a
fresh trace gives, they train bitwise as eager, and a trace made for another step is refused by name."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bench.tiny_models import DropoutBN, make_batch
from tests.helpers import eager_step, eager_twin
from transpiler import (
    ConfigurationError,
    DiLoCo,
    Execution,
    LocalSGD,
    StepTrace,
    TraceCache,
    TraceMismatchError,
    trace_training_step,
    transpile,
)

LOSS = nn.CrossEntropyLoss()


def _model_and_optimizer(make_opt) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DropoutBN()
    return model, make_opt(model.parameters())


def _batches(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [make_batch("dropout_bn", size, gen) for _ in range(n)]


@pytest.mark.parametrize(
    "make_opt, shared",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05), "trace"),
        # the generic path, which tracing moves to its tensor form; its first step makes the state, so the second
        # traces again: a cache serves that build too
        (lambda ps: torch.optim.RAdam(ps, lr=1e-3), "cache"),
    ],
    ids=["adamw-trace", "radam-cache"],
)
def test_modes_built_from_one_trace_are_fresh_traces_and_train_as_them(make_opt, shared):
    """One trace (or one cache), made on another instance of the model, builds several modes: each program is,
    byte for byte, the one its own trace gives, and each trains bitwise as a step that traced itself (dropout's
    masks, BatchNorm's statistics, the optimizer's state) over steps that include a second batch shape. AdamW's
    step is also bitwise eager's; RAdam's tensor form holds eager's within a tolerance only
    (``test_generic_optimizers``). Not in the narrow-kernel lane: what it claims is that the programs are the same,
    which no choice of kernels changes (each mode's bits against eager and DDP are other tests' claims, which are in
    it)."""
    batches = _batches(3)
    cache = TraceCache()
    trace = trace_training_step(*_model_and_optimizer(make_opt), LOSS, batches[0]) if shared == "trace" else cache
    odd = _batches(1, size=6)[0]
    traced = 0
    for mode in ("none", "fused_allreduce", "zero1"):
        model, opt = _model_and_optimizer(make_opt)
        fresh_model, fresh_opt = _model_and_optimizer(make_opt)
        twin, twin_opt = eager_twin(model, lambda m: make_opt(m.parameters()))
        fresh = transpile(fresh_model, fresh_opt, mode, loss_fn=LOSS, example_inputs=batches[0])
        step = transpile(model, opt, mode, loss_fn=LOSS, example_inputs=batches[0], trace=trace)
        assert step.program.graph_module.code == fresh.program.graph_module.code, mode
        assert step.program.history == fresh.program.history, mode
        for batch in [*batches, odd, batches[0]]:
            losses = []
            for run in (step, fresh, functools.partial(_eager, twin, twin_opt)):
                torch.manual_seed(7)  # dropout draws from the global generator: the same masks for all
                losses.append(run(*batch))
            assert torch.equal(losses[0], losses[1]), mode
            if isinstance(opt, torch.optim.AdamW):
                assert torch.equal(losses[0], losses[2]), mode
        _assert_same_state(model, opt, fresh_model, fresh_opt)
        if isinstance(opt, torch.optim.AdamW):
            _assert_same_state(model, opt, twin, twin_opt)
        assert step.traces == fresh.traces, "a reused trace counts as a build"
        traced += fresh.traces
    if shared == "cache":  # the first mode traced every build; the others found them all
        assert (cache.misses, cache.hits) == (traced // 3, traced - traced // 3) and len(cache) == traced // 3


def _eager(model: nn.Module, opt: torch.optim.Optimizer, *batch: torch.Tensor) -> torch.Tensor:
    return eager_step(model, opt, LOSS, batch)


def _assert_same_state(model, opt, twin, twin_opt) -> None:
    """Bitwise: parameters, buffers and optimizer state (zero1 holds each state tensor flat)."""
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), twin.parameters()):
        assert set(opt.state[p]) == set(twin_opt.state[q])
        for key, value in twin_opt.state[q].items():
            assert torch.equal(opt.state[p][key].reshape(value.shape), value), key


def test_only_the_learning_rate_may_differ():
    """The learning rate is a per-step input of the graph, so a trace serves any; other hyper-parameters are
    baked in."""
    batch = _batches(1)[0]

    def sgd(lr: float, momentum: float):
        return _model_and_optimizer(lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum))

    trace = trace_training_step(*sgd(0.1, 0.9), LOSS, batch)
    transpile(*sgd(0.5, 0.9), loss_fn=LOSS, example_inputs=batch, trace=trace)
    with pytest.raises(TraceMismatchError, match=r"param group 0 momentum: 0\.8 here, 0\.9 in the trace"):
        transpile(*sgd(0.1, 0.8), loss_fn=LOSS, example_inputs=batch, trace=trace)


def test_a_trace_for_another_step_is_refused_by_name():
    batch = _batches(1)[0]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    trace = trace_training_step(*_model_and_optimizer(sgd), LOSS, batch)
    cases = {
        r"batch element 0: \(\(6, 20\), 'float32', 'cpu'\) here, \(\(8, 20\)": dict(batch=_batches(1, size=6)[0]),
        r"module '<root>': .*DropoutBN, eval here, .*training in the trace": dict(change=lambda m: m.eval()),
        r"module 'body\.3'\.p: 0\.3 here, 0\.5 in the trace": dict(change=lambda m: setattr(m.body[3], "p", 0.3)),
        r"parameter 'body\.0\.weight': absent here, .*'trainable'\) in the trace": dict(
            change=lambda m: m.body[0].weight.requires_grad_(False)
        ),
        r"loss_fn: .*MSELoss": dict(loss=nn.MSELoss()),
    }
    for message, case in cases.items():
        model, opt = _model_and_optimizer(sgd)
        case.get("change", lambda m: None)(model)
        loss, data = case.get("loss", LOSS), case.get("batch", batch)
        with pytest.raises(TraceMismatchError, match=message):
            transpile(model, opt, loss_fn=loss, example_inputs=data, trace=trace)
    with pytest.raises(ConfigurationError, match="trace must be what transpiler.trace_training_step.*TraceCache"):
        transpile(*_model_and_optimizer(sgd), loss_fn=LOSS, trace=trace.program)
    assert isinstance(trace, StepTrace) and "torch.optim.sgd.SGD" in repr(trace)


def test_without_example_inputs_the_first_call_checks_the_trace():
    batch = _batches(1)[0]
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    trace = trace_training_step(*_model_and_optimizer(adam), LOSS, batch)
    step = transpile(*_model_and_optimizer(adam), loss_fn=LOSS, trace=trace)
    with pytest.raises(TraceMismatchError, match="batch element 0"):
        step(*_batches(1, size=6)[0])


class _Net(nn.Module):
    def __init__(self, width: int, p: float, act: nn.Module, squash) -> None:
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(4, width), act, nn.Dropout(p), nn.Linear(width, 3)
        self.squash = squash  # a plain function attribute: what the forward calls is part of the signature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.squash(self.fc1(x)))))


_CHOICES = {
    "width": [5, 6],
    "p": [0.0, 0.25],
    "act": ["relu", "gelu", "gelu_tanh"],
    "squash": ["tanh", "sigmoid"],
    "optimizer": ["sgd", "sgd_momentum", "adam", "adam_betas", "rprop"],
    "lr": [0.1, 0.01],
    "rows": [2, 3],
    "train": [True, False],
    "loss": ["ce", "ce_smooth"],
}


@st.composite
def _two_steps(draw) -> tuple[dict, dict]:
    """A step, and the same step with up to two of its choices drawn again (often the same: equal steps)."""
    a = {key: draw(st.sampled_from(values)) for key, values in _CHOICES.items()}
    again = draw(st.sets(st.sampled_from(sorted(_CHOICES)), max_size=2))
    return a, a | {key: draw(st.sampled_from(_CHOICES[key])) for key in sorted(again)}


def _traced(s: dict) -> StepTrace:
    act = {"relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh")}[s["act"]]
    model = _Net(s["width"], s["p"], act, getattr(torch, s["squash"])).train(s["train"])
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=s["lr"]),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=s["lr"], momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=s["lr"]),
        "adam_betas": lambda ps: torch.optim.Adam(ps, lr=s["lr"], betas=(0.8, 0.9)),
        "rprop": lambda ps: torch.optim.Rprop(ps, lr=s["lr"]),
    }[s["optimizer"]]
    loss = nn.CrossEntropyLoss(label_smoothing=0.1 if s["loss"] == "ce_smooth" else 0.0)
    return trace_training_step(
        model, make(model.parameters()), loss, (torch.randn(s["rows"], 4), torch.tensor([0, 1, 2][: s["rows"]]))
    )


@settings(max_examples=12)
@given(_two_steps())
def test_equal_signatures_mean_equal_graphs(steps):
    """Whatever two steps are, a trace of one is accepted for the other only if a fresh trace of the other is
    the same graph (the property reuse rests on)."""
    a, b = steps
    ta, tb = _traced(a), _traced(b)
    if ta.signature == tb.signature:
        assert ta.program.graph_module.code == tb.program.graph_module.code
    else:
        assert ta.signature.first_difference(tb.signature) is not None
    only_lr = {k: v for k, v in a.items() if k != "lr"} == {k: v for k, v in b.items() if k != "lr"}
    assert (ta.signature == tb.signature) == only_lr


def test_a_cache_keeps_its_traces_as_traced():
    """What a build adds to its traced program (DiLoCo's outer update, a measured cost) stays out of the cache: a
    mode built after DiLoCo from the same cache gets the plain trace, and its program is a fresh build's."""
    batch = _batches(1)[0]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    cache = TraceCache()
    transpile(*_model_and_optimizer(sgd), DiLoCo(sync_every=2), LOSS, batch, trace=cache)
    step = transpile(*_model_and_optimizer(sgd), LocalSGD(k_steps=2), LOSS, batch, trace=cache)
    fresh = transpile(*_model_and_optimizer(sgd), LocalSGD(k_steps=2), LOSS, batch)
    assert (cache.misses, cache.hits) == (1, 1)
    assert all(p.outer_update is None for p in step.programs.values())
    assert {v: p.graph_module.code for v, p in step.programs.items()} == {
        v: p.graph_module.code for v, p in fresh.programs.items()
    }


def test_builds_from_a_cache_share_its_graph_and_never_rewrite_it():
    """A build starts from the cached trace's graph itself (a copy of its fields only: a deep copy cost each build
    a tenth of its time) and rewrites its own clone: after a mode and a memory budget's recompute, which rewrites
    the traced step in place, the cached graph's code is still the trace's, node for node. About 2 s."""
    batch = _batches(1)[0]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    cache = TraceCache()
    kept = cache.trace(*_model_and_optimizer(sgd), LOSS, batch)
    code, nodes = kept.program.graph_module.code, len(kept.program.graph.nodes)
    transpile(*_model_and_optimizer(sgd), "zero1", LOSS, batch, trace=cache)
    budget = transpile(
        *_model_and_optimizer(sgd), "none", LOSS, batch, trace=cache, execution=Execution(memory_budget=0.0)
    )
    assert "recompute" in budget.program.decisions  # the budget rewrote its traced step
    assert (cache.misses, cache.hits) == (1, 2)
    assert kept.program.graph_module.code == code and len(kept.program.graph.nodes) == nodes


def test_a_cache_keeps_the_traces_used_most_recently():
    """``max_traces`` bounds what a cache holds: the trace used least recently goes first."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    cache = TraceCache(max_traces=2)
    sizes = (4, 5, 4, 6, 5)  # 5 was used less recently than 4 when 6 came in
    for size in sizes:
        cache.trace(*_model_and_optimizer(sgd), LOSS, _batches(1, size=size)[0])
    assert (cache.misses, cache.hits, len(cache)) == (4, 1, 2)
    with pytest.raises(ConfigurationError, match="max_traces must be an int >= 1"):
        TraceCache(max_traces=0)
