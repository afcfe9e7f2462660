"""A model under torch's tensor-parallel plan, held as this rank's local shards, and traced through DTensor.

``parallelize_module(model, mesh["tp"], plan)`` turns a model's parameters into DTensors. :func:`localize` puts
a plain parameter holding each one's local shard (the same storage) in its place, in the model and in the
optimizer, and keeps what DTensor needs to rebuild it: the mesh, the placements, the global shape and stride.
Everything past tracing (the passes, the runtime, the data-parallel mode across the other mesh dimension) then
sees ordinary tensors, each rank's shard.

Whenever the model is called, a forward pre-hook on its root wraps every local shard it finds back into a DTensor
(``DTensor.from_local``, differentiable) for that call, so the plan's hooks and DTensor's dispatch run as they
would on the user's model: traced under ``make_fx`` this leaves the local aten ops and TP's ``_c10d_functional``
collectives on the ``tp`` group, and autograd hands back local gradients, a Partial one (a norm's weight under
sequence parallel) reduced over ``tp`` first. Called eagerly between steps (evaluation), the model computes what
it did before :func:`localize`.

The optimizer then updates each shard on its own, so its update must be element-wise (``check_update``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.nn.utils.stateless import _reparametrize_module

from transpiler.errors import ConfigurationError, UnsupportedOptimizerError

ATTRIBUTE = "_transpiler_tensor_parallel"  # where a localized model keeps its TensorParallel


@dataclass(frozen=True)
class ShardSpec:
    """What ``DTensor.from_local`` needs to rebuild one parameter from this rank's shard."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


@dataclass
class TensorParallel:
    """A localized model's shards (parameter name -> spec), its tensor-parallel mesh, and the handles of the hooks
    that wrap the shards back into DTensors for each call."""

    specs: dict[str, ShardSpec]
    mesh: DeviceMesh
    handles: tuple = ()

    @property
    def size(self) -> int:
        return self.mesh.size()


def tensor_parallel_of(model: torch.nn.Module) -> TensorParallel | None:
    """The plan :func:`localize` left on ``model``, or None for a model without one."""
    return getattr(model, ATTRIBUTE, None)


def has_dtensor_parameters(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters()) or any(
        isinstance(b, DTensor) for b in model.buffers()
    )


def localize(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> TensorParallel:
    """Replace every DTensor parameter of ``model`` by a parameter holding its local shard (same storage), in the
    model and in ``optimizers`` (their state too); return the specs, kept on the model. A model localized before
    (a second ``transpile()``) is returned as it is."""
    known = tensor_parallel_of(model)
    if known is not None:
        return known
    if any(isinstance(b, DTensor) for b in model.buffers()):
        name = next(n for n, b in model.named_buffers() if isinstance(b, DTensor))
        raise ConfigurationError(
            f"buffer '{name}' is a DTensor: a tensor-parallel plan here may split parameters only. Keep buffers "
            "plain tensors (replicated)."
        )
    specs: dict[str, ShardSpec] = {}
    replaced: dict[int, torch.nn.Parameter] = {}
    meshes = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        spec = ShardSpec(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))
        _check_spec(name, spec)
        specs[name] = spec
        meshes.append(p.device_mesh)
        replaced[id(p)] = torch.nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
    if not specs:
        raise ConfigurationError("the model has no DTensor parameter: apply a tensor-parallel plan first.")
    mesh = meshes[0]
    if any(m != mesh for m in meshes):
        raise ConfigurationError(
            "the model's DTensor parameters live on more than one device mesh; a tensor-parallel plan here spans "
            "one 1-D mesh (mesh['tp'] of a ('dp', 'tp') mesh). Apply parallelize_module once, on mesh['tp']."
        )
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in replaced:
                module._parameters[key] = replaced[id(p)]
    for optimizer in optimizers:
        _rebind(optimizer, replaced)
    plan = TensorParallel(specs, mesh)
    plan.handles = (
        model.register_forward_pre_hook(_enter_dtensors, prepend=True),
        model.register_forward_hook(_leave_dtensors, always_call=True),
    )
    setattr(model, ATTRIBUTE, plan)
    return plan


def _check_spec(name: str, spec: ShardSpec) -> None:
    if spec.mesh.ndim != 1:
        raise ConfigurationError(
            f"parameter '{name}' is a DTensor on a {spec.mesh.ndim}-D mesh; apply the tensor-parallel plan on the "
            "1-D mesh of its dimension (mesh['tp']), and give transpile() the other one (mesh=mesh['dp'])."
        )
    for placement in spec.placements:
        if isinstance(placement, Partial) or not isinstance(placement, (Shard, Replicate)):
            raise ConfigurationError(
                f"parameter '{name}' is placed as {placement}; a parameter is held sharded (Shard) or replicated "
                "(Replicate) over the tensor-parallel mesh."
            )


def _rebind(optimizer: torch.optim.Optimizer, replaced: dict[int, torch.nn.Parameter]) -> None:
    """The optimizer over the local parameters: its groups name them, its state (DTensors) becomes local."""
    members = getattr(optimizer, "members", None)
    if members is not None:  # a chain of optimizers: each of them
        for member in members:
            _rebind(member, replaced)
        return
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for p in list(optimizer.state):
        if id(p) in replaced:
            state = optimizer.state.pop(p)
            optimizer.state[replaced[id(p)]] = {
                k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()
            }


_active: list[ExitStack] = []  # one per call of a localized model in progress (the hooks of nested calls)


def _enter_dtensors(model: torch.nn.Module, args: tuple) -> None:
    stack = ExitStack()
    _active.append(stack)  # first: the post-hook runs even when entering fails, and must pop this call's entry
    stack.enter_context(dtensor_parameters(model))


def _leave_dtensors(model: torch.nn.Module, args: tuple, output: object) -> None:
    if _active:
        _active.pop().close()


@contextmanager
def dtensor_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Inside, each parameter of the plan that the model holds as a local tensor (its own, or what tracing put
    in its place) is a DTensor wrapping it; one that is a DTensor already stays."""
    specs = tensor_parallel_of(model).specs
    wrapped = {}
    for name, spec in specs.items():
        owner, _, attr = name.rpartition(".")
        value = getattr(model.get_submodule(owner), attr)
        if not isinstance(value, DTensor):
            wrapped[name] = spec.wrap(value)
    if not wrapped:
        yield
        return
    with _reparametrize_module(model, wrapped, tie_weights=True, strict=False):
        yield


def as_local(t: object) -> object:
    """A DTensor result of the step (the loss, a model output) as the whole value on every rank; others as they
    are."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def check_update(graph: fx.Graph) -> None:
    """Each rank updates its shards on their own, so no op of the optimizer may reduce a tensor to fewer
    elements (a norm, a sum, a matrix product): it would see one shard, not the parameter."""
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("role") != "optimizer":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        widest = max(
            (i.meta["val"].numel() for i in node.all_input_nodes if isinstance(i.meta.get("val"), torch.Tensor)),
            default=0,
        )
        if val.numel() < widest and not getattr(node.target, "is_view", False):
            raise UnsupportedOptimizerError(
                f"the optimizer's update runs {node.target} ('{node.name}'), which reduces a tensor to fewer "
                "elements. Under a tensor-parallel plan each rank updates its shards of the parameters on their "
                "own, so the update must be element-wise (SGD, Adam, AdamW, RMSprop, Adagrad...)."
            )
