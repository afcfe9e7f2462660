"""Eager reference training, comparisons and the published AdaSum (numpy) shared by the tests."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import torch

from bench.tiny_models import MLP, make_batch
from transpiler import Accumulation, Clipping, PassPipeline, mode_config, transpile
from transpiler.graph.pipeline import Pass
from transpiler.graph.ports import Port
from transpiler.strategies.mode_config import ALONE, Surroundings
from transpiler.strategies.modes import MODES
from transpiler.strategies.strategy import Strategy


def strategy_of(mode: str, surroundings: Surroundings = ALONE, **options) -> Strategy:
    """The strategy of a mode's name with its options, or of a pipeline spec."""
    config = mode_config(mode, **options) if mode in MODES else PassPipeline(spec=mode)
    return config.strategy(surroundings)


def passes_of(mode: str, **options) -> list[Pass]:
    """The passes of a mode with one program variant (its name with its options), or of a pipeline spec."""
    variants = strategy_of(mode, **options).variants
    assert list(variants) == ["step"], f"mode '{mode}' has several program variants ({', '.join(variants)})"
    return variants["step"]


def eager_twin(model: torch.nn.Module, make_opt):
    twin = copy.deepcopy(model)
    return twin, make_opt(twin)


def eager_step(model, optimizer, loss_fn, batch, autocast: tuple[str, torch.dtype | None] = ("cpu", None)):
    """One eager step; ``autocast=(device_type, dtype)`` puts the forward and the loss under autocast (dtype
    None: off), the backward and the update outside it, as torch documents autocast."""
    optimizer.zero_grad()
    device_type, dtype = autocast
    with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()


def state_addresses(model, optimizer) -> list[int]:
    """Where the parameters, buffers and optimizer-state tensors live: equal lists, the same storage."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [t.data_ptr() for t in tensors]


def assert_same_training_state(model_a, opt_a, model_b, opt_b) -> None:
    """Bitwise: parameters, buffers and every optimizer-state tensor."""
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs"
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert set(sa) == set(sb), f"state keys differ: {set(sa)} vs {set(sb)}"
        for key in sb:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), f"optimizer state {key} differs"


def assert_rewrite_is_final(program, passes, where: str = "") -> None:
    """Running the passes again on their own output changes nothing: each says so, and the code is the same."""
    code = program.graph_module.code
    for p in passes:
        assert p.run(program) is False, f"{where}{p.name} changed an already rewritten graph"
    program.recompile()
    assert program.graph_module.code == code


class ReplayByCalling:
    """Stands in for torch.cuda's capture on the CPU (``cuda_graph.CAPTURER``): a replay calls the captured
    function, which is what a correct capture means, so everything around the capture runs without a GPU. It keeps
    torch's rule for memory pools: a pool whose graphs were all freed takes no new capture (the caching allocator
    asserts ``use_count > 0``), so a capture that replaces another must hold the old graph until it is done."""

    host_split = False  # on the CPU every tensor is on the host

    def __init__(self) -> None:
        self.pools = 0
        self.graphs: dict[tuple, weakref.WeakSet] = {}  # pool -> its graphs still alive
        self.used: set[tuple] = set()  # pools captured into

    def new_pool(self) -> tuple:
        self.pools += 1
        return ("cpu-test-pool", self.pools)

    @staticmethod
    def warm_up(fn):
        return fn()

    def capture(self, fn, pool):
        graphs = self.graphs.setdefault(pool, weakref.WeakSet())
        if pool in self.used and not graphs:
            raise RuntimeError(f"it->second->use_count > 0 INTERNAL ASSERT FAILED (stand-in): pool {pool} was freed")
        self.used.add(pool)
        replay = Replay(fn)  # a real capture runs no kernel now either
        graphs.add(replay)
        return replay


class Replay:
    """A stand-in graph: replaying it calls the captured function."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


def capture_by_calling(setattr_) -> None:
    """Make ``cuda_graph=True`` capture with :class:`ReplayByCalling` and skip its setup check (a GPU, NCCL:
    tests/test_gpu.py). ``setattr_`` is ``monkeypatch.setattr`` in a test, ``setattr`` in a spawned rank."""
    from transpiler.runtime import cuda_graph

    setattr_(cuda_graph, "CAPTURER", ReplayByCalling())
    setattr_(cuda_graph, "check_capturable_setup", lambda *args: None)


def run_by_ports(program, values: dict) -> dict:
    """Run ``program``'s graph on ``values`` (a tensor per input port, as the traced program takes them) and return
    a tensor per output port. Flat buffers (``flatten-update``) are filled from the per-parameter values as the
    runtime lays them out, and their views come back under the ports of the parameters and state they hold."""
    feeds, flats = dict(values), []
    for layout in program.flat_buffers:
        buffer = torch.zeros(layout.length, dtype=getattr(torch, layout.dtype), device=layout.device)
        ports = [
            Port("param", n) if layout.kind == "param" else Port("state", f"{n}.{layout.key}") for n in layout.names
        ]
        for port, start, shape in zip(ports, layout.starts, layout.shapes):
            numel = torch.Size(shape).numel()
            buffer[start : start + numel].copy_(values[port].reshape(-1))
        feeds[Port("flat", layout.port)] = buffer
        flats.append((layout, ports, buffer))
    results = dict(zip(program.outputs, program.graph_module(*[feeds[p] for p in program.inputs])))
    for layout, ports, buffer in flats:
        for port, start, shape in zip(ports, layout.starts, layout.shapes):
            results[port] = buffer[start : start + torch.Size(shape).numel()].view(shape)
    return results


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """AdaSum of two vectors (Maleki et al.): (1 - a·b/(2|a|²)) a + (1 - a·b/(2|b|²)) b, a zero vector's
    coefficient 1."""
    dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 if na == 0 else 1 - dot / (2 * na)
    cb = 1.0 if nb == 0 else 1 - dot / (2 * nb)
    return ca * a + cb * b


def adasum_tree(vectors: list[list[np.ndarray]]) -> list[np.ndarray]:
    """vectors[rank][tensor] -> the AdaSum of all ranks, tensor by tensor."""
    level = [[v.astype(np.float64).ravel() for v in rank] for rank in vectors]
    while len(level) > 1:
        level = [[combine(a, b) for a, b in zip(level[i], level[i + 1])] for i in range(0, len(level), 2)]
    return level[0]


def quantised_sum(vectors: list[np.ndarray], exchange: str, block: int = 64) -> np.ndarray:
    """The float32 sum of every rank's vector as docs/strategies/diloco.md states the low-precision exchange:
    each padded to ``W`` chunks of whole ``block``s, each rank's chunk rounded to the wire format, the chunks summed
    in float32 in rank order, the sum rounded to the wire format again. Written from that statement in numpy
    (torch only for the bfloat16 and float8 casts, which define those formats' rounding)."""
    world, length = len(vectors), vectors[0].size
    unit = world * block
    padded = -(-length // unit) * unit
    rows = [np.pad(v.astype(np.float32), (0, padded - length)) for v in vectors]
    total = np.zeros(padded, dtype=np.float32)
    for row in rows:
        total = total + _round_trip(row, exchange, block)
    return _round_trip(total, exchange, block)[:length]


def _round_trip(x: np.ndarray, exchange: str, block: int) -> np.ndarray:
    """``x`` (float32) as the receiver decodes it."""
    if exchange == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    top = {"float8_e4m3fn": np.float32(448.0), "int4": np.float32(7.0)}[exchange]
    blocks = x.reshape(-1, block)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / top
    scale[scale == 0] = np.float32(1.0)
    scaled = (blocks / scale).astype(np.float32)
    if exchange == "int4":
        codes = np.clip(np.rint(scaled), -7, 7).astype(np.float32)
    else:
        codes = torch.from_numpy(scaled).to(torch.float8_e4m3fn).to(torch.float32).numpy()
    return (codes * scale).astype(np.float32).reshape(-1)


def trained(mode: str, options: dict, inner, outer=None, autocast: bool = False) -> list[torch.Tensor]:
    """12 calls of ``mode`` at W=1 on an MLP from seed 0, the given composition, optionally under bfloat16
    autocast: the weights at the end."""
    torch.manual_seed(0)
    model = MLP()
    outer_optimizer = outer(model.parameters()) if outer else None
    config = mode_config(mode, **options)
    step = transpile(
        model, inner(model.parameters()), config, torch.nn.CrossEntropyLoss(), outer_optimizer=outer_optimizer
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        x, y = make_batch("mlp", 8, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            step(x, y)
    return [p.detach().clone() for p in model.parameters()]


# the composition trained() is asked for most
COMPOSED = {"accumulation": Accumulation(steps=2), "clipping": Clipping(max_norm=0.05)}


def resumed_matches(mode: str, options: dict, inner, folder, via: str) -> list[tuple[str, bool]]:
    """8 calls of ``mode`` at W=1, and the same 8 resumed after the 4th from ``step.state_dict()`` (``via="state"``)
    or a DCP checkpoint in ``folder`` (``"dcp"``) in a fresh model, optimizer and step: per parameter, whether the
    two runs end with the same bits."""
    gen = torch.Generator().manual_seed(1)
    batches = [make_batch("mlp", 8, gen) for _ in range(8)]
    ends, saved = {}, {}
    for how in ("straight", "resumed"):
        torch.manual_seed(0)
        model = MLP()
        step = transpile(model, inner(model.parameters()), mode_config(mode, **options), torch.nn.CrossEntropyLoss())
        for t, batch in enumerate(batches, start=1):
            if how == "resumed" and t == 5:
                step.load_state_dict(saved) if via == "state" else step.load_checkpoint(folder)
            if how == "resumed" and t <= 4:
                continue
            step(*batch)
            if how == "straight" and t == 4:
                saved = copy.deepcopy(step.state_dict()) if via == "state" else step.save_checkpoint(folder)
        ends[how] = dict(model.named_parameters())
    return [(n, torch.equal(p, ends["resumed"][n])) for n, p in ends["straight"].items()]


EXCHANGE_OPS = frozenset({"transpiler::sparse_select", "transpiler::sparse_decode_mean"})


def exchange_ops_run(step, batch) -> set[str]:
    """The sparse exchange's custom ops that one call of ``step(*batch)`` dispatches (torch.profiler's events): a
    program that runs them as opaque ops does, one whose exchange Inductor compiled does not."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(*batch)
    return {e.name for e in prof.events()} & EXCHANGE_OPS
