"""Why tracing a step failed, said plainly: a batch that does not fit the model or the loss, a model that fails on
its own, or a step that one static graph cannot describe.

Tracing runs on fake tensors, so torch's own error names an aten op deep inside the model, and fake-tensor
dispatch logs its traceback first. Here that log is kept back (:func:`quiet_fake_tensor_failures`), the step
notes which part of it was running (:class:`Phase`), and when the forward or the loss failed, or the trace holds a
matrix product of two dtypes (the fake kernels let it through, the real ones refuse it), the forward and the loss
run once more, eagerly, on the real batch (:func:`probe`): without autograd, on copies of the buffers, with the
random state put back, and with a hook on every module that notes which one was running when it raised. A
``torch.nn`` layer that rejects a tensor of the batch itself (or a view of it), or a loss that rejects the target
after the forward ran, is a :class:`BatchMismatchError` naming the input, its shape and dtype and what the layer
expects; a failure elsewhere that eager PyTorch repeats is the model's own error; one that eager PyTorch does not
repeat is the tracer's limit (:class:`UnsupportedModelError`). This runs only once tracing has failed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from transpiler.errors import BatchMismatchError, TranspilerError, UnsupportedModelError

from .environment import AutocastState

_DATA_DEPENDENT = (
    "data-dependent",
    "DataDependentOutputException",
    "GuardOnDataDependentSymNode",
    "Could not guard on data-dependent",
    "item()",
    "DynamicOutputShapeException",
)
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"
_META_FAILURE = "failed while attempting to run meta for"
# matrix products whose two operands the real kernels require to share a dtype (CPU and CUDA), and where they are
_OPS = torch.ops.aten
_MATMULS = {
    _OPS.mm.default: (0, 1),
    _OPS.bmm.default: (0, 1),
    _OPS.mv.default: (0, 1),
    _OPS.dot.default: (0, 1),
    _OPS.addmm.default: (1, 2),
    _OPS.baddbmm.default: (1, 2),
    _OPS.addbmm.default: (1, 2),
    _OPS.addmv.default: (1, 2),
}
# lookups whose indices the real kernels require to be integers, and where they are: some torch releases' meta
# kernels (2.11's embedding) let float indices through a trace
_LOOKUPS = {_OPS.embedding.default: 1, _OPS._embedding_bag.default: 1, _OPS.embedding_bag.default: 1}


class RefusedDtypes(RuntimeError):
    """The trace holds an op whose operands' dtypes fake tensors allow and the real kernels refuse: a matrix
    product of two dtypes, a lookup by float indices."""


class Phase:
    """Which part of the step is being traced: ``inputs``, ``forward``, ``loss``, ``backward`` or ``update``."""

    def __init__(self) -> None:
        self.current = "inputs"


class _DropMetaFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_META_FAILURE)


@contextlib.contextmanager
def quiet_fake_tensor_failures() -> Iterator[None]:
    """Keep back fake-tensor dispatch's error log of a failed meta kernel (20 lines of torch's traceback at level
    ERROR): the exception itself reaches :func:`explain`, which says what went wrong."""
    logger, drop = logging.getLogger(_FAKE_TENSOR_LOG), _DropMetaFailures()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def check_operand_dtypes(graph: fx.Graph) -> None:
    """Raise :class:`RefusedDtypes` for the first matrix product in ``graph`` whose operands differ in dtype, or
    the first lookup by indices that are not integers."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _LOOKUPS:
            indices = _dtypes(node, (_LOOKUPS[node.target],))
            if indices and (indices[0].is_floating_point or indices[0].is_complex):
                raise RefusedDtypes(f"{node.target} by {indices[0]} indices (the real kernel wants int64 or int32)")
        dtypes = _dtypes(node, _MATMULS.get(node.target, ()))
        if len(dtypes) == 2 and dtypes[0] != dtypes[1]:
            raise RefusedDtypes(f"{node.target} of {dtypes[0]} and {dtypes[1]} (the real kernel refuses it)")


def _dtypes(node: fx.Node, positions: tuple[int, ...]) -> list[torch.dtype]:
    """The dtypes of ``node``'s tensor arguments at ``positions``, as the trace recorded them."""
    values = [node.args[i].meta.get("val") for i in positions if isinstance(node.args[i], fx.Node)]
    return [v.dtype for v in values if isinstance(v, torch.Tensor)]


@dataclass(frozen=True)
class Rejection:
    """What failed when the forward and the loss ran eagerly: the innermost module running (``None``: the loss
    function), its name in the model, the tensors it was given, and the error."""

    module: nn.Module | None
    name: str
    inputs: tuple[torch.Tensor, ...]
    error: Exception


def probe(
    model: nn.Module,
    loss_fn: Any,
    batch: tuple,
    tensors: dict[str, torch.Tensor],
    autocast: AutocastState,
) -> Rejection | None:
    """Run the forward (on ``tensors``, the model's parameters and copies of its buffers by name) and the loss
    eagerly on ``batch``; where it raises, or None when both run. Nothing of the model or the random state
    changes."""
    names = {id(m): n for n, m in model.named_modules()}
    running: list[tuple[nn.Module, tuple]] = []

    def entered(module: nn.Module, args: tuple) -> None:
        if id(module) in names:
            running.append((module, args))

    def left(module: nn.Module, args: tuple, output: Any) -> None:
        while running and running.pop()[0] is not module:
            pass

    inputs = batch[:-1] if loss_fn is not None else batch
    held = [t for t in (*batch, *tensors.values()) if isinstance(t, torch.Tensor) and t.is_cuda]
    devices = sorted({t.device.index or 0 for t in held})  # each GPU's random state is put back too
    hooks = [
        nn.modules.module.register_module_forward_pre_hook(entered),
        nn.modules.module.register_module_forward_hook(left),
    ]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            with _reparametrize_module(model, tensors, tie_weights=True, strict=False), autocast.applied():
                try:
                    out = model(*inputs)
                except Exception as error:  # noqa: BLE001 - the error is what this reports
                    module, args = running[-1] if running else (model, tuple(inputs))
                    return Rejection(module, names.get(id(module), ""), _tensors(args), error)
                if loss_fn is None:
                    return None
                try:
                    loss_fn(out, batch[-1])
                except Exception as error:  # noqa: BLE001
                    return Rejection(None, "", (*_tensors((out,)), batch[-1]), error)
    finally:
        for hook in hooks:
            hook.remove()
    return None


def explain(
    exc: Exception,
    phase: str,
    model: nn.Module,
    loss_fn: Any,
    batch: tuple,
    tensors: dict[str, torch.Tensor],
    autocast: AutocastState,
) -> TranspilerError:
    """The error to raise for ``exc``, which tracing raised while in ``phase`` (see the module's docstring), with
    its cause set: none for a batch that does not fit (the message says it all), eager PyTorch's error for the
    model's own, ``exc`` for the tracer's limit."""
    if phase in ("forward", "loss") or isinstance(exc, RefusedDtypes):
        try:
            rejection = probe(model, loss_fn, batch, tensors, autocast)
        except Exception:  # noqa: BLE001 - the probe only explains; the trace's own error stands without it
            rejection = None
        if rejection is not None:
            error = _rejected(rejection, model, loss_fn, batch)
            # a batch error says all there is to say; a model's own error points into its forward, as eager ran it
            rejection.error.__suppress_context__ = True  # it was raised while the trace's error was handled
            error.__cause__ = None if isinstance(error, BatchMismatchError) else rejection.error
            error.__suppress_context__ = True
            return error
    text = f"{type(exc).__name__}: {exc}"
    if any(marker in text for marker in _DATA_DEPENDENT):
        error = UnsupportedModelError(
            "the model's forward (or the loss) has data-dependent control flow or reads a tensor value "
            "in Python (if x.sum() > 0, .item(), .tolist(), nonzero...), so one static graph cannot describe "
            "every step. Rewrite it with torch.where / masks, or keep that logic outside the model. "
            f"Torch said: {text.splitlines()[0][:300]}"
        )
    else:
        error = UnsupportedModelError(f"tracing the training step failed: {text.splitlines()[0][:500]}")
    error.__cause__ = exc
    return error


def _rejected(rejection: Rejection, model: nn.Module, loss_fn: Any, batch: tuple) -> TranspilerError:
    said = f"torch: {_first_line(rejection.error)}"
    if rejection.module is None:  # the forward ran; the loss refused the target with the model's output
        target, outputs = batch[-1], rejection.inputs[:-1]
        given = ", ".join(_describe(t) for t in outputs) or "no tensor"
        return BatchMismatchError(
            f"the loss function ({_name_of(loss_fn)}) rejects the target, the batch's last tensor "
            f"({_describe(target)}), against the model's output ({given}): {said}. The model's forward ran on "
            "this batch; the target does not fit what the loss expects of it (its shape, its dtype: class indices "
            "are int64). Fix the target, or loss_fn."
        )
    inputs = batch[:-1] if loss_fn is not None else batch
    if rejection.module is model and not _takes(model, inputs):  # the forward was never entered
        given = ", ".join(_describe(t) for t in inputs) or "none"
        return BatchMismatchError(
            f"the batch gives the model {len(inputs)} input(s) ({given}){' before its target' * bool(loss_fn)}, "
            f"and {type(model).__name__}.forward{inspect.signature(model.forward)} does not take them: {said}. The "
            "model itself is fine; give the step its inputs first and the target last."
        )
    module, where = rejection.module, _where(rejection)
    index = _batch_index(rejection.inputs, batch)
    expects = _expects(module)
    expected = f", which expects {expects}" if expects else ""
    if index is not None and _is_torch_layer(module):
        which = f"input {index} of the batch" if loss_fn is not None or len(batch) > 1 else "the batch"
        return BatchMismatchError(
            f"{which} ({_describe(batch[index], _device_of(module))}) does not fit {where}{expected}: {said}. The "
            "model itself is fine: "
            "this is the first layer that rejects the batch. Give the step a batch shaped and typed as the model "
            "expects (its inputs first, the target last)."
        )
    got = ", ".join(_describe(t) for t in rejection.inputs) or "no tensor"
    origin = f"input {index} of the batch" if index is not None else "what the model computed before it"
    return UnsupportedModelError(
        f"the model fails on this batch outside the transpiler too (run eagerly): {where}{expected}, got {got} "
        f"from {origin}: {said}. This is an error in the model's forward, not a limit of the transpiler."
    )


def _takes(model: nn.Module, inputs: tuple) -> bool:
    """Whether the model's forward takes ``inputs`` as its positional arguments."""
    try:
        inspect.signature(model.forward).bind(*inputs)
    except TypeError:
        return False
    return True


def _tensors(args: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor))


def _batch_index(inputs: tuple[torch.Tensor, ...], batch: tuple) -> int | None:
    """The batch tensor one of ``inputs`` is, or is a view of (the same storage)."""
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage().data_ptr()
        if any(x.numel() and x.device == t.device and x.untyped_storage().data_ptr() == storage for x in inputs):
            return i
    return None


def _is_torch_layer(module: nn.Module) -> bool:
    """A layer of ``torch.nn`` itself with no submodules: what it rejects, it rejects by its documented contract."""
    return type(module).__module__.startswith("torch.nn.") and not any(True for _ in module.children())


def _expects(module: nn.Module) -> str | None:
    """What ``module`` takes, for the layers a batch usually meets first."""
    param = next(module.parameters(recurse=False), None)
    typed = "" if param is None else f" {str(param.dtype).removeprefix('torch.')}"
    typed += f" on {param.device}" if param is not None and param.device.type != "cpu" else ""
    if isinstance(module, nn.Linear):
        return f"(*, {module.in_features}){typed}"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return f"integer indices (int64 or int32) below {module.num_embeddings}"
    if isinstance(module, nn.modules.conv._ConvNd):
        spatial = {1: "L", 2: "H, W", 3: "D, H, W"}[len(module.kernel_size)]
        return f"(N, {module.in_channels}, {spatial}) or ({module.in_channels}, {spatial}){typed}"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"(N, {module.num_features}, ...){typed}"
    if isinstance(module, nn.GroupNorm):
        return f"(N, {module.num_channels}, ...){typed}"
    if isinstance(module, nn.LayerNorm):
        return f"(*, {', '.join(map(str, module.normalized_shape))}){typed}"
    if isinstance(module, nn.RNNBase):
        order = "(N, L" if module.batch_first else "(L, N"
        return f"{order}, {module.input_size}) or (L, {module.input_size}){typed}"
    if isinstance(module, nn.MultiheadAttention):
        return f"(*, {module.embed_dim}){typed} queries, keys and values"
    return None


def _device_of(module: nn.Module) -> torch.device | None:
    return next((p.device for p in module.parameters(recurse=False)), None)


def _where(rejection: Rejection) -> str:
    module = rejection.module
    text = f"{type(module).__name__}({module.extra_repr()})" if module.extra_repr() else type(module).__name__
    return f"layer '{rejection.name}' = {text}" if rejection.name else f"the model ({text})"


def _name_of(loss_fn: Any) -> str:
    return type(loss_fn).__name__ if isinstance(loss_fn, nn.Module) else getattr(loss_fn, "__name__", repr(loss_fn))


def _describe(t: Any, device: torch.device | None = None) -> str:
    """Shape and dtype, and the device where it is not the CPU or not ``device`` (the layer's)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    where = f", on {t.device}" if t.device.type != "cpu" or (device is not None and t.device != device) else ""
    return f"shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}{where}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300].rstrip(".")
