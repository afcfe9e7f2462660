"""``transpile(..., cuda_graph=True)``: each program variant captured once as a CUDA graph and replayed every step.

The uncaptured step is host-bound on a GPU: Python issues every aten call of forward, backward, collectives
and update. A captured program issues them all with one ``replay()``. What makes that correct:

- **Persistent inputs.** Parameters, buffers, optimizer state, pass-added state and the twins' per-step
  scalars (``scalar_bank.py``) are the same tensors every step, so the graph reads and writes them where
  they are. Each step checks their addresses; if one changed (``optimizer.load_state_dict`` makes new state
  tensors, say), the program is captured again. The batch is copied into static buffers.
- **In place.** An output that replaces a stateful input (``param``, ``state``, ``buffer``, ``extra``,
  ``frozen``) must land in that input's storage. ``reinplace-optimizer`` makes the optimizer's updates in
  place; an output that is still a new tensor (a BatchNorm statistic, a LocalSGD snapshot) is copied into
  its input inside the capture, so the user's tensors stay the same objects. An output with no input to
  land in cannot be captured and is refused.
- **Host work stays on the host.** A replay runs no CPU op. The nodes that compute CPU tensors (Adam's step
  count lives on the CPU, as in eager) are split into a small host program that runs eagerly before each
  replay; the captured device program no longer holds them. A CPU value that feeds a device op, or a
  device value read on the host (``.item()``, ``nonzero``), would be baked into the capture or cannot be
  captured at all: refused, naming the node.
- **Warm-up, then capture.** The first ``WARMUP_STEPS`` calls are ordinary steps on a side stream (they
  let cuBLAS, cuDNN and NCCL set themselves up, and ``compile=True`` compile); the next call captures and
  replays. Warm-up and replay run the same host and device programs, so captured steps are bitwise the
  uncaptured ones. The variants of one program (LocalSGD's ``local`` and ``sync``) share one memory pool.
- **Outputs.** The loss is cloned out of the graph's static output (the next replay overwrites it);
  metrics are read after the replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from transpiler.errors import ConfigurationError, UnsupportedOptimizerError
from transpiler.graph.program import StepProgram
from transpiler.trace.optimizers import TWINS

from .process_group import Placement

aten = torch.ops.aten
log = logging.getLogger("transpiler")
WARMUP_STEPS = 2
STATEFUL = ("param", "state", "buffer", "extra", "frozen")  # output kinds that replace an input of that name
HOST_SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}


def check_capturable_setup(model: torch.nn.Module, optimizer: torch.optim.Optimizer, placement: Placement) -> None:
    """What ``cuda_graph=True`` needs before anything is traced: CUDA, the model on it, NCCL, a twin optimizer."""
    if not torch.cuda.is_available():
        raise ConfigurationError("cuda_graph=True needs a CUDA device, and torch sees none; leave it off here.")
    devices = sorted({p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()})
    if devices != ["cuda"]:
        raise ConfigurationError(
            f"cuda_graph=True captures the step on a GPU, but the model's tensors are on {devices}. "
            "Move the model first (model.to('cuda')), then build the optimizer and transpile()."
        )
    if type(optimizer) not in TWINS:
        raise UnsupportedOptimizerError(
            f"cuda_graph=True: {type(optimizer).__name__} takes the generic path, which computes its step sizes "
            "in Python from the step count every step; a captured graph would replay the first step's values. "
            "Use SGD, Adam or AdamW (their per-step values are device tensors), or leave cuda_graph off."
        )
    if placement.live:
        backend = _backend(placement.group_name)
        if backend != "nccl":
            raise ConfigurationError(
                f"cuda_graph=True needs the NCCL backend for the step's collectives; this step's group uses "
                f"{backend}. Call torch.distributed.init_process_group('nccl', device_id=...) before transpile() "
                "(also for a world of one)."
            )


def _backend(group_name: str) -> str:
    try:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "none (no process group was initialised)"


def _devices(node: fx.Node) -> set[str]:
    """The device types of the tensors a node produces (a multi-output kernel's included)."""
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    return {v.device.type for v in values if isinstance(v, torch.Tensor)}


def _on_cpu(node: fx.Node) -> bool:
    return _devices(node) == {"cpu"}


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if _devices(a)]


def split_host_nodes(graph: fx.Graph, variant: str) -> set[fx.Node]:
    """The call nodes that compute CPU tensors from the program's inputs (Adam's step count), after checking
    that none feeds a device op and none reads a device value. CPU constants (no input among their
    ancestors) stay with the device part: the capture keeps their one value, which is right for them."""
    varying: set[fx.Node] = set()  # CPU values that can change from step to step
    for node in graph.nodes:
        if node.op == "placeholder" and _on_cpu(node):
            varying.add(node)
        elif node.op == "call_function" and _on_cpu(node) and any(a in varying for a in node.all_input_nodes):
            varying.add(node)
    host = {n for n in varying if n.op == "call_function"}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in HOST_SYNCS:
            raise ConfigurationError(
                f"cuda_graph=True: the '{variant}' program turns a tensor into a Python number on the host "
                f"({node.name}, {node.target}); a replay would keep the number of the step it was captured on. "
                "Leave cuda_graph off for this mode."
            )
        inputs = _tensor_inputs(node)
        if _on_cpu(node) and any(not _on_cpu(a) for a in inputs):
            raise ConfigurationError(
                f"cuda_graph=True: {node.name} in the '{variant}' program copies a device value to the host, "
                "which a capture cannot hold. Leave cuda_graph off for this mode."
            )
        fed = next((a for a in inputs if a in varying), None)
        if node not in host and fed is not None:
            raise ConfigurationError(
                f"cuda_graph=True: the CPU value {fed.name} feeds {node.name} on the device in the '{variant}' "
                "program; a capture would keep its first value for ever. Leave cuda_graph off for this mode."
            )
    return host


def host_and_device(
    gm: fx.GraphModule, variant: str, split: bool = True
) -> tuple[fx.GraphModule, fx.GraphModule, list[int]]:
    """Two programs over the same inputs: the host part (the CPU nodes, eager each step) and the device part
    (everything else, captured), and which output positions the host part fills. ``split=False`` (a CPU
    test's capture) leaves the host part empty."""
    graph = gm.graph
    host = split_host_nodes(graph, variant) if split else set()
    output = graph.output_node()
    values = list(output.args[0])
    host_positions = [i for i, v in enumerate(values) if isinstance(v, fx.Node) and v in host]

    needed = set(host)  # the host nodes and the constants they read (a bucket view's get_attr, say)
    for node in reversed(graph.nodes):
        if node in needed:
            needed.update(node.all_input_nodes)
    host_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = host_graph.node_copy(node, lambda n: env[n])
    host_graph.output(tuple(env[values[i]] for i in host_positions))

    device_graph = fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op == "output":
            device_graph.output(
                tuple(
                    None if i in host_positions else env[v] if isinstance(v, fx.Node) else v
                    for i, v in enumerate(values)
                )
            )
        elif node not in host:
            env[node] = device_graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, host_graph), fx.GraphModule(gm, device_graph), host_positions


def device_inputs(device_gm: fx.GraphModule) -> set[int]:
    """The positions of the inputs that the device part reads (its placeholders are the program's inputs, in
    order; those only the host part reads have no user here)."""
    placeholders = [n for n in device_gm.graph.nodes if n.op == "placeholder"]
    return {i for i, node in enumerate(placeholders) if node.users}


class CudaCapturer:
    """How :class:`CapturedProgram` warms up, captures and replays: torch.cuda's streams and graphs. The one
    thing a CPU test replaces (``tests/test_cuda_graph.py`` replays by calling the captured function), so
    the rest of the machinery runs in CI."""

    host_split = True  # the device is not the host: CPU nodes go to the host part

    @staticmethod
    def new_pool() -> tuple:
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def warm_up(fn: Callable[[], object]) -> object:
        """Run ``fn`` on a side stream, ordered after and before the current one (as capture wants)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = fn()
        torch.cuda.current_stream().wait_stream(side)
        return result

    @staticmethod
    def capture(fn: Callable[[], object], pool: tuple) -> Callable[[], None]:
        """Capture ``fn`` (its kernels do not run now) into a graph in ``pool``; returns what replays it."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay


CAPTURER = CudaCapturer()


class CapturedProgram:
    """One program variant: host part eager, device part warmed up, then captured and replayed."""

    def __init__(
        self,
        program: StepProgram,
        variant: str,
        pool: tuple,
        wrap_device: Callable[[fx.GraphModule, str], Callable] | None = None,
        capturer: CudaCapturer = CAPTURER,
    ):
        self.variant = variant
        self.pool = pool
        self.capturer = capturer
        self.host, device_gm, self.host_positions = host_and_device(program.graph_module, variant, capturer.host_split)
        self.device = wrap_device(device_gm, variant) if wrap_device is not None else device_gm
        self.seconds = getattr(self.device, "seconds", None)  # compile time, when compiled
        index = {(p.kind, p.name): i for i, p in enumerate(program.inputs)}
        self.batch_positions = [i for i, p in enumerate(program.inputs) if p.kind == "batch"]
        self.lands_in: dict[int, int] = {}  # output position -> the input position it replaces
        for o, port in enumerate(program.outputs):
            if port.kind in STATEFUL:
                if (port.kind, port.name) not in index:
                    raise ConfigurationError(
                        f"cuda_graph=True: the '{variant}' program outputs {port.kind} '{port.name}' that it takes "
                        "no input for, so it cannot be written in place. Leave cuda_graph off for this mode."
                    )
                self.lands_in[o] = index[(port.kind, port.name)]
        self.loss_position = next((o for o, p in enumerate(program.outputs) if p.kind == "loss"), None)
        self.device_reads = device_inputs(device_gm)
        self.calls = 0
        self.replay: Callable[[], None] | None = None
        self.static_inputs: list = []
        self.static_outputs: tuple = ()
        self.addresses: list[int] = []
        self.copied: list[int] = []  # outputs copied into their input inside the capture (not already in place)
        self.captures = 0

    def __call__(self, *inputs) -> tuple:
        self.calls += 1
        if self.calls <= WARMUP_STEPS:
            return self._warm_up(list(inputs))
        if self.replay is None or self._addresses(inputs) != self.addresses:
            self._capture(list(inputs))
        else:
            for i in self.batch_positions:
                self.static_inputs[i].copy_(inputs[i])
        host_outputs = self.host(*inputs)
        self.replay()
        return self._outputs(self.static_outputs, host_outputs, self.static_inputs)

    def _addresses(self, inputs) -> list[int]:
        """Where the captured part reads each input. The batch is copied into static buffers, and an input only the
        host part reads (Adam's step count, a new tensor each step) is not the capture's concern."""
        return [
            t.data_ptr()
            if isinstance(t, torch.Tensor) and i in self.device_reads and i not in self.batch_positions
            else 0
            for i, t in enumerate(inputs)
        ]

    def _warm_up(self, inputs: list) -> tuple:
        def run() -> tuple:
            host_outputs, outputs = self.host(*inputs), self.device(*inputs)
            self._land(outputs, inputs)
            return host_outputs, outputs

        host_outputs, outputs = self.capturer.warm_up(run)
        self.seconds = getattr(self.device, "seconds", None)
        return self._outputs(outputs, host_outputs, inputs)

    def _land(self, outputs, inputs) -> list[int]:
        """Copy each stateful output that is not already in its input's storage into it; returns which."""
        copied = []
        for o, i in self.lands_in.items():
            out, target = outputs[o], inputs[i]
            if out is None:  # filled by the host part
                continue
            if out.data_ptr() != target.data_ptr():
                target.copy_(out)
                copied.append(o)
        return copied

    def _capture(self, inputs: list) -> None:
        """Capture the device part on these inputs (the batch copied into static buffers)."""
        start = time.perf_counter()
        replaced, self.replay = self.replay, None  # held until the new graph exists: see below
        self.static_inputs = [t.clone() if i in self.batch_positions else t for i, t in enumerate(inputs)]

        def body() -> None:
            self.static_outputs = self.device(*self.static_inputs)
            self.copied = self._land(self.static_outputs, self.static_inputs)

        try:
            replay = self.capturer.capture(body, self.pool)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0][:300]
            raise ConfigurationError(
                f"cuda_graph=True: capturing the '{self.variant}' program failed ({first}). Something in it "
                "synchronises with the host or allocates outside the graph's pool; leave cuda_graph off for it."
            ) from exc
        # The graph replaced lives until here: a pool whose graphs were all freed takes no capture (torch's caching
        # allocator asserts `use_count > 0`), and the variants of a program share one pool.
        del replaced
        self.replay = replay
        self.addresses = self._addresses(inputs)
        self.captures += 1
        log.info(
            "captured the '%s' program as a CUDA graph in %.2f s (capture %d; %d outputs copied into their inputs)",
            self.variant,
            time.perf_counter() - start,
            self.captures,
            len(self.copied),
        )

    def _outputs(self, outputs, host_outputs, inputs) -> tuple:
        """What the runtime writes back: stateful outputs as their inputs' tensors (a new host value, such as
        Adam's step count, copied into its input first, so the user's state tensors stay where they are), other
        host values as the host part made them, and the loss as a copy of the static output."""
        out = list(outputs)
        for position, value in zip(self.host_positions, host_outputs):
            out[position] = value
        for o, i in self.lands_in.items():
            if o in self.host_positions and out[o].data_ptr() != inputs[i].data_ptr():
                inputs[i].copy_(out[o])
            out[o] = inputs[i]
        if self.loss_position is not None:
            out[self.loss_position] = out[self.loss_position].detach().clone()
        return tuple(out)
