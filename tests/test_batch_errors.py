"""A batch that does not fit the model or the loss gets one clear ``BatchMismatchError`` (issue 62): which input,
its shape and dtype, what the first layer that rejects it expects, and that the model itself is fine; nothing
printed before it (fake-tensor dispatch logs its own traceback at level ERROR unless kept back). A model that fails
on a batch that fits it is still the model's error, and a step one graph cannot describe still the tracer's limit.
Each case traces one small step in this process: about 2 s in all."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx, nn

from transpiler import BatchMismatchError, ConfigurationError, UnsupportedModelError, transpile
from transpiler.trace.batch_fit import RefusedDtypes, check_operand_dtypes

pytestmark = pytest.mark.quick  # the quick tier: 2 s

CE = nn.CrossEntropyLoss()


def _step(model: nn.Module, loss_fn=CE):
    return transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn)


def _raised(step, batch, capfd, caplog) -> Exception:
    """What the step raised on ``batch``, checking that neither torch nor anything else printed or logged a word
    before it."""
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG), pytest.raises(Exception) as info:
        step(*batch)
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), err[-2000:]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[-2000:]
    return info.value


def test_an_input_of_the_wrong_width_names_the_input_the_layer_and_what_it_expects(capfd, caplog):
    error = _raised(_step(nn.Linear(8, 4)), (torch.randn(2, 7), torch.tensor([0, 1])), capfd, caplog)
    assert type(error) is BatchMismatchError and isinstance(error, ConfigurationError)
    message = str(error)
    assert message.startswith("input 0 of the batch (shape (2, 7), float32) does not fit the model (Linear(")
    assert "which expects (*, 8) float32" in message and "The model itself is fine" in message
    assert error.__cause__ is None and error.__suppress_context__  # nothing of torch's traceback above it


def test_an_input_of_the_wrong_dtype_is_caught_before_the_step_runs(capfd, caplog):
    """Fake tensors let a float64 batch through a float32 Linear; the real kernel would refuse it mid-step."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 4))
    before = [p.clone() for p in model.parameters()]
    batch = (torch.randn(2, 2, 4, dtype=torch.float64), torch.tensor([0, 1]))
    step = _step(model)
    error = _raised(step, batch, capfd, caplog)
    assert type(error) is BatchMismatchError
    assert "input 0 of the batch (shape (2, 2, 4), float64) does not fit layer '1' = Linear(" in str(error)
    assert "expects (*, 8) float32" in str(error)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the refused batch's types are not remembered: the user's fixed batch trains (the GPU lane checks the same
    # for a batch left on the CPU)
    assert torch.isfinite(step(batch[0].float(), batch[1]))


@pytest.mark.parametrize(
    "target, why",
    [(torch.tensor([0, 1, 2]), "batch_size"), (torch.tensor([0.0, 1.0]), "dtype")],
    ids=["three-targets-for-two-samples", "float-class-indices"],
)
def test_a_target_the_loss_rejects_names_the_target_and_the_models_output(target, why, capfd, caplog):
    error = _raised(_step(nn.Linear(8, 4)), (torch.randn(2, 8), target), capfd, caplog)
    assert type(error) is BatchMismatchError
    message = str(error)
    assert message.startswith("the loss function (CrossEntropyLoss) rejects the target, the batch's last tensor")
    assert f"({'shape (3,), int64' if why == 'batch_size' else 'shape (2,), float32'})" in message
    assert "the model's output (shape (2, 4), float32)" in message and why in message


@pytest.mark.parametrize(
    "model, batch, expects",
    [
        (nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 4)), torch.rand(2, 3), "integer indices"),
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 4)), torch.rand(2, 1, 8, 8), "(N, 3, H, W)"),
        (nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 4)), torch.rand(2, 5), "(*, 6)"),
    ],
    ids=["embedding-fed-floats", "conv-fed-one-channel", "layernorm-fed-the-wrong-width"],
)
def test_the_first_layer_that_rejects_the_batch_says_what_it_expects(model, batch, expects, capfd, caplog):
    error = _raised(_step(model), (batch, torch.tensor([0, 1])), capfd, caplog)
    assert type(error) is BatchMismatchError
    assert "input 0 of the batch" in str(error) and "layer '0' = " in str(error) and expects in str(error)


@pytest.mark.parametrize("indices", [torch.float32, torch.int64], ids=["float", "int64"])
def test_a_lookup_by_float_indices_in_a_traced_graph_is_refused_before_it_runs(indices):
    """Some torch releases' meta kernels let float indices through an embedding (2.11's does, and the real kernel
    then raised mid-step with torch's own message); the trace's check refuses them whatever the release."""
    graph = fx.Graph()
    weight, ids = graph.placeholder("weight"), graph.placeholder("ids")
    weight.meta["val"], ids.meta["val"] = torch.empty(10, 4), torch.empty(2, 3, dtype=indices)
    graph.output(graph.call_function(torch.ops.aten.embedding.default, (weight, ids)))
    if indices == torch.int64:
        check_operand_dtypes(graph)
        return
    with pytest.raises(RefusedDtypes, match=r"aten.embedding.default by torch.float32 indices .*int64 or int32"):
        check_operand_dtypes(graph)


def test_a_batch_with_more_inputs_than_the_forward_takes_says_so(capfd, caplog):
    """(x, x2, y) for a model whose forward takes x alone: the batch's structure, not the model, is wrong."""
    batch = (torch.randn(2, 8), torch.randn(2, 8), torch.tensor([0, 1]))
    error = _raised(_step(nn.Sequential(nn.Linear(8, 4))), batch, capfd, caplog)
    assert type(error) is BatchMismatchError
    assert str(error).startswith("the batch gives the model 2 input(s) (shape (2, 8), float32, shape (2, 8), float32)")
    assert "Sequential.forward(input)" in str(error) and "The model itself is fine" in str(error)


def test_a_model_that_fails_on_a_batch_that_fits_it_is_the_models_error(capfd, caplog):
    """The second Linear takes 32 features from a first that gives 16: the batch is fine, the model is not."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(32, 4))
    error = _raised(_step(model), (torch.randn(2, 8), torch.tensor([0, 1])), capfd, caplog)
    assert type(error) is UnsupportedModelError
    message = str(error)
    assert "outside the transpiler too" in message and "layer '2' = Linear(in_features=32" in message
    assert "got shape (2, 16), float32 from what the model computed before it" in message
    assert "error in the model's forward" in message and "batch (" not in message
    assert isinstance(error.__cause__, RuntimeError)  # eager PyTorch's error, its traceback in the model


def test_a_step_one_graph_cannot_describe_is_still_the_tracers_limit(capfd, caplog):
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    error = _raised(_step(Branchy()), (torch.ones(2, 8), torch.tensor([0, 1])), capfd, caplog)
    assert type(error) is UnsupportedModelError and "data-dependent control flow" in str(error)


def test_a_batch_that_fits_after_one_that_did_not_trains_and_nothing_was_touched():
    """The eager probe runs on copies of the buffers and with the random state put back: a BatchNorm's statistics
    and the next random draw are as if the bad batch had never been given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    step = _step(model)
    with pytest.raises(BatchMismatchError):
        step(torch.randn(4, 8), torch.tensor([0, 1, 2]))
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    narrow, state = torch.randn(4, 7), torch.random.get_rng_state()
    with pytest.raises(BatchMismatchError):
        step(narrow, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(state, torch.random.get_rng_state())
    assert torch.isfinite(step(torch.randn(4, 8), torch.tensor([0, 1, 2, 3])))
