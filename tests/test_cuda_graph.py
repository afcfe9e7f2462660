"""``cuda_graph=True`` without a GPU: the machinery around the capture, run in CI.

A CUDA graph can only be captured on a GPU (``tests/test_gpu.py`` does that, with NCCL). Everything around
it is plain Python and runs here: the warm-up steps, the static batch buffers, the outputs landed in their
inputs' storage, the address check that captures again when a tensor it reads gets new storage, the per-variant
runners of a retrace, the loss handed out as a copy. For that, the capture is replaced by one that replays
by calling the captured function (what a correct capture means), and the setup check (a GPU, NCCL) is
skipped. The split into host and device parts is checked on graphs whose device values live on ``meta``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

from bench.tiny_models import make_batch, make_model
from tests.helpers import capture_by_calling, state_addresses
from transpiler import Accumulation, Clipping, ConfigurationError, Execution, LossScaling, mode_config, transpile
from transpiler.runtime import cuda_graph as cg

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
}
CASES = {  # label: (model, optimizer, mode, options)
    "fused_sgd": ("mlp", "sgd", "fused_allreduce", {}),
    "fused_adamw": ("mlp", "adamw", "fused_allreduce", {}),
    "cnn_batchnorm": ("cnn", "sgd", "fused_allreduce", {}),
    "tied_adamw": ("tied", "adamw", "fused_allreduce", {}),
    "none": ("mlp", "adamw", "none", {}),
    "local_sgd": ("mlp", "sgd", "local_sgd", {"k_steps": 3}),
    "accumulate": ("mlp", "adamw", "fused_allreduce", {"accumulation": Accumulation(steps=2)}),
    "clip_loss_scale": (
        "mlp",
        "sgd",
        "fused_allreduce",
        {"clipping": Clipping(max_norm=1.0), "loss_scaling": LossScaling()},
    ),
    "zero1": ("tied", "adamw", "zero1", {}),
    "zero2": ("mlp", "adamw", "zero2", {}),
    "zero3": ("tied", "adamw", "zero3", {}),
}


@pytest.fixture(autouse=True)
def replay_by_calling(monkeypatch):
    capture_by_calling(monkeypatch.setattr)


def _pair(model_name, opt_name, mode, options):
    torch.manual_seed(0)
    model = make_model(model_name)
    twin = copy.deepcopy(model)
    plain_opt, captured_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](twin.parameters())
    loss_fn = nn.CrossEntropyLoss()
    plain = transpile(model, plain_opt, mode_config(mode, **options), loss_fn)
    captured = transpile(
        twin, captured_opt, mode_config(mode, **options), loss_fn, execution=Execution(cuda_graph=True)
    )
    return (model, plain_opt, plain), (twin, captured_opt, captured)


def _run_both(plain, captured, model_name, steps, gen) -> list[torch.Tensor]:
    """``steps`` steps of both on the same batches, checked bitwise after each; returns the captured losses."""
    losses = []
    for _ in range(steps):
        batch = make_batch(model_name, 8, gen)
        expected, loss = plain[2](*batch), captured[2](*batch)
        assert torch.equal(loss, expected)
        for a, b in zip(plain[0].state_dict().values(), captured[0].state_dict().values()):
            assert torch.equal(a, b)
        for s1, s2 in zip(plain[1].state.values(), captured[1].state.values()):
            assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
        assert plain[2].last_metrics == captured[2].last_metrics
        losses.append(loss)
    return losses


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_steps_are_the_uncaptured_steps_and_keep_the_users_tensors(case):
    """12 steps: two warm-ups, the capture, replays. Every variant is captured once, and from the first
    replay on the model's parameters, buffers and optimizer state stay the same storage."""
    model_name, opt_name, mode, options = CASES[case]
    plain, captured = _pair(model_name, opt_name, mode, options)
    gen = torch.Generator().manual_seed(1)
    losses = _run_both(plain, captured, model_name, 3, gen)
    addresses = state_addresses(captured[0], captured[1])
    losses += _run_both(plain, captured, model_name, 9, gen)
    assert state_addresses(captured[0], captured[1]) == addresses
    assert set(captured[2].captures.values()) == {1}
    assert len({loss.data_ptr() for loss in losses}) == len(losses)  # each loss handed out is its own copy


def test_new_state_tensors_are_copied_into_the_capture_and_a_retrace_has_its_own_capture():
    """A checkpoint loaded into the optimizer brings new state tensors; the step copies their values into its flat
    buffers (runtime/flat_storage.py), where the capture reads them, so it replays on and stays bitwise."""
    plain, captured = _pair("cnn", "adamw", "fused_allreduce", {})
    gen = torch.Generator().manual_seed(2)
    _run_both(plain, captured, "cnn", 4, gen)
    for _, optimizer, _ in (plain, captured):  # the same checkpoint into both: new optimizer-state tensors
        optimizer.load_state_dict(copy.deepcopy(plain[1].state_dict()))
    _run_both(plain, captured, "cnn", 2, gen)
    assert captured[2].captures == {"step": 1}
    for model, _, _ in (plain, captured):
        model.eval()
    _run_both(plain, captured, "cnn", 2, gen)
    assert captured[2].captures == {"step": 0}  # the eval program is still warming up
    _run_both(plain, captured, "cnn", 2, gen)
    assert captured[2].captures == {"step": 1}


def test_a_buffer_given_new_storage_is_captured_again_in_the_same_pool():
    """``bn.running_mean.data = ...`` between steps moves what the capture reads, so the step captures again. It
    must hold the graph it replaces until the new one exists: a pool whose graphs were all freed takes no capture
    (torch asserts; the stand-in keeps that rule). Both stay bitwise the uncaptured step."""
    plain, captured = _pair("cnn", "sgd", "fused_allreduce", {})
    gen = torch.Generator().manual_seed(4)
    _run_both(plain, captured, "cnn", 4, gen)
    assert captured[2].captures == {"step": 1}
    for model, _, _ in (plain, captured):
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        bn.running_mean.data = bn.running_mean.clone()
    _run_both(plain, captured, "cnn", 3, gen)
    assert captured[2].captures == {"step": 2}


def test_zero3_gathered_between_steps_keeps_the_capture():
    """zero3 between steps: ``step.gathered()`` makes the parameters whole (an evaluation, an edit written back)
    and puts each rank's slice back into the tensor it was, so the captured program keeps reading its inputs
    where it captured them: one capture over 10 steps, bitwise the uncaptured step doing the same."""
    plain, captured = _pair("tied", "adamw", "zero3", {})
    gen = torch.Generator().manual_seed(4)
    _run_both(plain, captured, "tied", 3, gen)
    addresses = state_addresses(captured[0], captured[1])
    probe = make_batch("tied", 8, gen)[0]
    for i in range(7):
        _run_both(plain, captured, "tied", 1, gen)
        outputs = []
        for model, _, step in (plain, captured):
            with step.gathered():
                outputs.append(model(probe))
                if i == 2:
                    with torch.no_grad():
                        next(model.parameters()).mul_(0.5)  # written back: each rank keeps its slice
        assert torch.equal(*outputs)
    assert state_addresses(captured[0], captured[1]) == addresses
    assert captured[2].captures == {"step": 1}


def test_batch_is_copied_into_static_buffers():
    """A replay reads the batch from the buffers it was captured with, refilled each step: the caller's
    tensors may be reused or freed."""
    plain, captured = _pair("mlp", "sgd", "fused_allreduce", {})
    gen = torch.Generator().manual_seed(3)
    _run_both(plain, captured, "mlp", 3, gen)
    runner = captured[2]._state.built.runners["step"]
    batch = make_batch("mlp", 8, gen)
    expected, loss = plain[2](*batch), captured[2](*batch)
    assert torch.equal(loss, expected)
    assert all(torch.equal(runner.static_inputs[i], t) for i, t in zip(runner.batch_positions, batch))
    assert all(runner.static_inputs[i] is not t for i, t in zip(runner.batch_positions, batch))


# ------------------------------------------------------------ the host/device split, on meta "device" values
def _graph(build) -> fx.GraphModule:
    """A graph from ``build(graph, step, x)``; ``step`` is a CPU counter and ``x`` a device tensor (on meta)."""
    graph = fx.Graph()
    step, x = graph.placeholder("step"), graph.placeholder("x")
    step.meta["val"], x.meta["val"] = torch.zeros(()), torch.empty(4, device="meta")
    graph.output(build(graph, step, x))
    for node in graph.nodes:  # values as tracing would record them
        if node.op == "call_function":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            if "device" in kwargs:  # a copy off meta has no data to copy: its value's place is what counts
                node.meta["val"] = torch.empty(args[0].shape, device=kwargs["device"])
            else:
                node.meta["val"] = node.target(*args, **kwargs)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_host_nodes_run_apart_from_the_captured_part():
    aten = torch.ops.aten

    def build(g, step, x):
        counted = g.call_function(aten.add_.Tensor, (step, 1))
        doubled = g.call_function(aten.mul.Tensor, (x, 2))
        return (doubled, counted)

    host, device, positions = cg.host_and_device(_graph(build), "step")
    assert positions == [1]
    assert [n.target for n in host.graph.nodes if n.op == "call_function"] == [aten.add_.Tensor]
    assert [n.target for n in device.graph.nodes if n.op == "call_function"] == [aten.mul.Tensor]
    step, x = torch.zeros(()), torch.empty(4, device="meta")
    assert host(step, x)[0] is step and step.item() == 1
    assert device(step, x)[1] is None and step.item() == 1  # the device part leaves the counter alone
    assert cg.device_inputs(device) == {1}  # so a new counter tensor each step is no reason to capture again


@pytest.mark.parametrize(
    "what, message",
    [
        ("cpu_feeds_device", "CPU value add_tensor feeds mul_tensor on the device"),
        ("device_to_host", "copies a device value to the host"),
        ("item", "turns a tensor into a Python number"),
    ],
)
def test_what_a_capture_would_get_wrong_is_refused(what, message):
    aten = torch.ops.aten

    def build(g, step, x):
        if what == "cpu_feeds_device":
            later = g.call_function(aten.add.Tensor, (step, 1))
            return (g.call_function(aten.mul.Tensor, (x, later)),)
        if what == "device_to_host":  # how tracing records x.cpu()
            return (g.call_function(aten._to_copy.default, (x,), {"device": torch.device("cpu")}),)
        return (g.call_function(aten._local_scalar_dense.default, (step,)),)

    gm = _graph(build)
    with pytest.raises(ConfigurationError, match=message):
        cg.host_and_device(gm, "step")


def test_compiled_and_captured_is_bitwise_compiled():
    """``compile=True`` with ``cuda_graph=True``: the device part is compiled during the warm-up, then captured."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make_model("mlp")
    twin = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    plain_opt, captured_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](twin.parameters())
    plain = transpile(model, plain_opt, "fused_allreduce", loss_fn, execution=Execution(compile=True))
    captured = transpile(
        twin, captured_opt, "fused_allreduce", loss_fn, execution=Execution(compile=True, cuda_graph=True)
    )
    _run_both((model, plain_opt, plain), (twin, captured_opt, captured), "mlp", 5, torch.Generator().manual_seed(4))
    assert captured.captures == {"step": 1} and captured.compile_seconds["step"] > 0
