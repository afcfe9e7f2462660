"""``dim-reduce``: MindSpore Boost's DimReduce, a quasi-Newton step in a PCA subspace, as a graph rewrite.

Requires: reduced (averaged) gradients (``scale-loss-grad`` and a reducing
pass before it) and a traced update that is plain SGD (no momentum, no weight
decay), which plays the part of Boost's ``SGD(learning_rate=1)``:
``optimizer(u)`` below is that update, ``w - lr * u``.
Guarantees, with ``P`` the basis (k × n, rows sharded over ranks as in the
seed: rank r holds rows ``r*kl .. r*kl+kl-1``, ``kl = ceil(k / W)``, zero
rows as padding) and ``g`` the averaged gradient flattened in layout order:

- ``gk = P g``: each rank projects onto its rows, an all-gather rebuilds it;
- BFGS: ``yk = gk - gk_last``; if a step was taken before and ``yk·sk > 1e-20``,
  ``bk = (I - yk skᵀ/yk·sk)ᵀ bk (I - yk skᵀ/yk·sk) + sk skᵀ/yk·sk``; ``dk = -bk gk``;
- ``dn = Pᵀ dk`` and ``Pᵀ gk``: each rank back-projects its rows, one
  all-reduce sums them;
- line search: for ``m = 0, 1`` the weights ``optimizer(-rho^m dn)`` and the
  loss there (a copy of the traced forward: *trial forwards*), averaged over
  ranks with the step's loss in one all-reduce; trial ``m`` passes when
  ``loss_m < loss + sigma rho^m gk·dk``. The first that passes gives ``rho``
  and ``sk = rho dk``; if none does, ``rho = 0`` and ``bk``, ``gk_last`` keep
  their old values (the seed's fallback);
- ``m = gamma m + g - Pᵀ gk`` (the residual momentum) and the update
  ``optimizer(alpha m - rho dn)``.

Both trials always run and the choice is made by ``where`` on tensors, so the
program is straight-line and every rank issues the same collectives. State
(extra, in ``step.state_dict()``): ``dim_reduce.bk``, ``dim_reduce.gk_last``,
``dim_reduce.sk``, ``dim_reduce.started`` and ``residual_momentum.<param>``.
Metrics: ``rho`` (1, ``rho`` or 0: which trial passed), ``curvature`` (``yk·sk``)
and ``avg_loss``. The basis is a constant of the graph (``dim_reduce_basis``);
its file's SHA-256 is in ``program.sources``, so ranks with other files fail
at the handshake. The math, symbol by symbol: ``docs/strategies/dim_reduce.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.basis import check_layout, read_basis
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import repair_order
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import DIM_REDUCE, RESIDUAL_MOMENTUM, ExtraInit, Port
from transpiler.graph.program import StepProgram

from .bucketing import unflatten
from .gradient_flow import (
    add_constant,
    add_outputs,
    add_state,
    before_output,
    fake_tensor,
    input_node,
    optimizer_gradients,
    output_values,
    retarget_optimizer_input,
)

aten = torch.ops.aten
F32 = torch.float32
STATE = ("bk", "gk_last", "sk", "started")
CURVATURE_FLOOR = 1e-20  # the seed's epsilon: below it the BFGS pair is skipped
TRIALS = 2  # rho^0 and rho^1, as the seed searches


def _private_inputs(nodes: list[fx.Node]) -> set[fx.Node]:
    """Inputs a trial forward must read from a copy, because the forward may update them in place: the model's
    buffers (``native_batch_norm`` updates the running statistics it is given, though its schema does not say
    so) and any value a schema marks as written (``a!``). Only the step's own forward updates the model."""
    private = set()
    for node in nodes:
        schema = getattr(node.target, "_schema", None)
        arguments = schema.arguments if schema is not None else []
        for i, value in enumerate(node.args):
            if not isinstance(value, fx.Node):
                continue
            port = value.meta.get("port")
            written = i < len(arguments) and arguments[i].alias_info is not None and arguments[i].alias_info.is_write
            if written or (value.op == "placeholder" and port is not None and port.kind == "buffer"):
                private.add(value)
    return private


def _f32(value: float) -> float:
    """A Python float rounded to float32, as the seed's float32 constants are."""
    return float(torch.tensor(value, dtype=F32))


@dataclass(frozen=True)
class DimReduce(Pass):
    name = "dim-reduce"
    requires = frozenset({Fact.FUNCTIONAL, Fact.REDUCED, Fact.PER_PARAMETER, Fact.UNFLATTENED})
    summary = "MindSpore Boost DimReduce: BFGS step in a PCA subspace with a line search, plus residual momentum"
    pca_path: str = option("", help="basis written by 'transpiler pca'")
    n_components: int = option(0, minimum=0, help="use the first k rows of the basis (0: all)")
    rho: float = option(0.55, minimum=1e-6, maximum=1, help="line-search factor: trials rho^0, rho^1")
    gamma: float = option(0.9, minimum=0, help="residual momentum decay")
    alpha: float = option(0.001, minimum=0, help="step on the residual momentum")
    sigma: float = option(0.4, minimum=0, help="Armijo factor of the line search")

    def run(self, program: StepProgram) -> bool:
        if any(p.kind == "extra" and p.name == f"{DIM_REDUCE}bk" for p in program.inputs):
            return False
        grads = optimizer_gradients(program)
        params = [p for p in program.inputs if p.kind == "param"]
        if [p.name for p in params] != list(grads):
            unused = [p.name for p in params if p.name not in grads]
            raise ConfigurationError(
                f"dim_reduce projects every trainable parameter's gradient, but {unused[:4]} get none from this "
                "loss. Freeze them (requires_grad=False) before transpile(), and build the basis without them."
            )
        local, k = self._basis(program, [input_node(program, p) for p in params])
        DimReduceGraph(program, list(grads.values()), local, self).build(k)
        return True

    def rows(self) -> torch.Tensor:
        """The first ``n_components`` rows of the basis file (all of them for 0), float32.

        The mode checks this at ``transpile()``, before tracing; the pass reads it (cached) when it runs."""
        if not self.pca_path:
            raise ConfigurationError(
                "dim_reduce needs pca_path=FILE: save a trajectory (save_trajectory=DIR) in an ordinary run, then "
                "'transpiler pca DIR -k K -o FILE'. See docs/strategies/dim_reduce.md."
            )
        rows = read_basis(self.pca_path)["pca_mat"].to(F32)
        if self.n_components > rows.shape[0]:
            raise ConfigurationError(
                f"n_components={self.n_components}, but {self.pca_path} holds {rows.shape[0]} components; ask for "
                "fewer, or build a larger basis with 'transpiler pca -k'."
            )
        return rows[: self.n_components or rows.shape[0]]

    def _basis(self, program: StepProgram, params: list[fx.Node]) -> tuple[torch.Tensor, int]:
        """This rank's rows of the basis (zero-padded to ``ceil(k / W)``) after checking its layout, and k."""
        rows = self.rows()
        basis = read_basis(self.pca_path)
        shapes = [list(p.meta["val"].shape) for p in params]
        check_layout(basis, [p.meta["port"].name for p in params], shapes, self.pca_path)
        dtypes = {p.meta["val"].dtype for p in params}
        if dtypes != {F32}:
            raise ConfigurationError(
                "dim_reduce computes in float32, as Boost does; the trainable parameters are "
                f"{sorted(map(str, dtypes))}. Train a float32 copy of the model."
            )
        world, rank = program.world_size, program.rank
        share = math.ceil(rows.shape[0] / world)
        local = torch.zeros(share, rows.shape[1], dtype=F32, device=params[0].meta["val"].device)
        mine = rows[rank * share : (rank + 1) * share]
        local[: mine.shape[0]] = mine.to(local.device)
        program.sources[f"pca basis {self.pca_path}"] = basis["digest"]
        return local, rows.shape[0]


class DimReduceGraph:
    """Emits the DimReduce step before the graph's output (see the module docstring for the math)."""

    def __init__(self, program: StepProgram, grads: list[fx.Node], basis: torch.Tensor, options: DimReduce):
        self.program = program
        self.grads = grads
        self.basis = basis
        self.o = options
        self.cursor = before_output(program)
        self.update = [n for n in program.graph.nodes if n.meta.get("role") == "optimizer"]  # the traced SGD
        self.names = [g.meta.get("reduced_grad_of", g.meta.get("grad_of")) for g in grads]

    def op(self, target, *args, **kwargs) -> fx.Node:
        return self.cursor.emit(target, args, kwargs, role="optimizer", dim_reduce=True)

    def comm(self, target, args: tuple, info: dict) -> fx.Node:
        started = self.cursor.emit(target, args, role="communication", collective=info)
        return self.cursor.emit(WAIT, (started,), role="communication")

    def build(self, k: int) -> None:
        program, world = self.program, self.program.world_size
        share = self.basis.shape[0]
        state = {name: self._state(name, shape) for name, shape in self._state_shapes(k).items()}
        momentum = {g: self._momentum(g, name) for g, name in zip(self.grads, self.names)}
        basis = add_constant(self.program, "dim_reduce_basis", self.basis, role="optimizer")
        pieces = [self.op(aten.reshape.default, g, [-1]) for g in self.grads]
        for piece in pieces:
            piece.meta["inspects"] = True  # reads the gradient; the optimizer will read the delta instead
        g_flat = pieces[0] if len(pieces) == 1 else self.op(aten.cat.default, pieces)
        gk_local = self.op(aten.mm.default, basis, self.op(aten.view.default, g_flat, [-1, 1]))
        gk = gk_local
        if world > 1:
            info = {"kind": "all_gather", "dim_reduce": ("gk",), "bytes": share * 4 * world}
            gathered = self.comm(C10D.all_gather_into_tensor.default, (gk_local, world, program.group_name), info)
            gk = self.op(aten.slice.Tensor, gathered, 0, 0, k)
        bk, curvature = self._bfgs(gk, state)
        dk = self.op(aten.mul.Tensor, self.op(aten.mm.default, bk, gk), -1.0)
        dn, grad_proj = self._back_project(dk, gk_local, basis, k)
        gkdk = self.op(aten.view.default, self.op(aten.mm.default, self.op(aten.t.default, gk), dk), [])
        losses = self._trial_losses(dn)
        old, rho, find = self._line_search(losses, gkdk)
        new_sk = self.op(aten.where.self, find, self.op(aten.mul.Tensor, dk, rho), state["sk"])
        new_bk = self.op(aten.where.self, find, bk, state["bk"])
        new_gk_last = self.op(aten.where.self, find, gk, state["gk_last"])
        new_momentum = []
        for g in self.grads:
            decayed = self.op(aten.mul.Tensor, momentum[g], self.o.gamma)
            plus = self.op(aten.add.Tensor, decayed, g)
            plus.meta["inspects"] = True
            residual = self.op(aten.sub.Tensor, plus, grad_proj[g])
            step = self.op(aten.mul.Tensor, residual, self.o.alpha)
            delta = self.op(aten.sub.Tensor, step, self.op(aten.mul.Tensor, dn[g], rho))
            new_momentum.append(residual)
            retarget_optimizer_input(g, delta)
        started = self.op(aten.ones_like.default, state["started"])
        add_outputs(
            program,
            [new_bk, new_gk_last, new_sk, started, *new_momentum, rho, curvature, old],
            [Port("extra", f"{DIM_REDUCE}{n}") for n in STATE]
            + [Port("extra", f"{RESIDUAL_MOMENTUM}{name}") for name in self.names]
            + [Port("metric", "rho"), Port("metric", "curvature"), Port("metric", "avg_loss")],
        )
        repair_order(program.graph)
        program.graph.eliminate_dead_code()

    # ------------------------------------------------------------ pieces
    @staticmethod
    def _state_shapes(k: int) -> dict[str, tuple[int, ...]]:
        return {"bk": (k, k), "gk_last": (k, 1), "sk": (k, 1), "started": ()}

    def _state(self, name: str, shape: tuple[int, ...]) -> fx.Node:
        if name == "started":
            like, rule = fake_tensor(self.program, torch.bool), ExtraInit.scalar(0, torch.bool)
        else:
            like = fake_tensor(self.program, F32, shape)
            rule = ExtraInit.eye(shape[0]) if name == "bk" else ExtraInit.zeros(shape)
        return add_state(self.program, f"{DIM_REDUCE}{name}", like, rule)

    def _momentum(self, grad: fx.Node, name: str) -> fx.Node:
        return add_state(self.program, f"{RESIDUAL_MOMENTUM}{name}", grad, ExtraInit.zeros_like(name))

    def _bfgs(self, gk: fx.Node, state: dict[str, fx.Node]) -> tuple[fx.Node, fx.Node]:
        """``bk`` after the BFGS update (taken only when a step was taken before and ``yk·sk > 1e-20``)."""
        op, t = self.op, lambda x: self.op(aten.t.default, x)
        sk, bk = state["sk"], state["bk"]
        yk = op(aten.sub.Tensor, gk, state["gk_last"])
        curvature = op(aten.view.default, op(aten.mm.default, t(yk), sk), [])
        take = op(aten.logical_and.default, state["started"], op(aten.gt.Scalar, curvature, CURVATURE_FLOOR))
        pk = op(aten.reciprocal.default, curvature)
        eye = op(aten.eye.default, sk.meta["val"].shape[0], dtype=F32, device=sk.meta["val"].device)
        t1 = op(aten.sub.Tensor, eye, op(aten.mm.default, op(aten.mul.Tensor, yk, pk), t(sk)))
        quadratic = op(aten.mm.default, op(aten.mm.default, t(t1), bk), t1)
        updated = op(aten.add.Tensor, quadratic, op(aten.mm.default, op(aten.mul.Tensor, sk, pk), t(sk)))
        return op(aten.where.self, take, updated, bk), curvature

    def _back_project(
        self, dk: fx.Node, gk_local: fx.Node, basis: fx.Node, k: int
    ) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
        """``Pᵀ dk`` and ``Pᵀ gk`` per gradient: this rank's rows back-projected, summed over ranks."""
        program, world = self.program, self.program.world_size
        share = self.basis.shape[0]
        dk_local = dk
        if world > 1:
            padded = dk
            if share * world > k:
                zeros = self.op(aten.new_zeros.default, dk, [share * world - k, 1])
                padded = self.op(aten.cat.default, [dk, zeros])
            rank = program.rank
            dk_local = self.op(aten.slice.Tensor, padded, 0, rank * share, (rank + 1) * share)
        both = self.op(aten.cat.default, [dk_local, gk_local], 1)
        rows = self.op(aten.mm.default, self.op(aten.t.default, both), basis)  # (2, n): dn and Pᵀ gk
        if world > 1:
            info = {"kind": "all_reduce", "dim_reduce": ("dn", "grad_proj"), "bytes": 2 * self.basis.shape[1] * 4}
            rows = self.comm(C10D.all_reduce_.default, (rows, "sum", program.group_name), info)
        meta = {"role": "optimizer", "dim_reduce": True}
        dn = unflatten(self.cursor, self.op(aten.select.int, rows, 0, 0), self.grads, meta)
        proj = unflatten(self.cursor, self.op(aten.select.int, rows, 0, 1), self.grads, meta)
        return dn, proj

    def _trial_losses(self, dn: dict[fx.Node, fx.Node]) -> list[fx.Node]:
        """The loss at ``optimizer(-rho^m dn)`` for each trial m: the traced update and forward, copied."""
        program = self.program
        loss = output_values(program)[0]
        params = {p.name: input_node(program, p) for p in program.inputs if p.kind == "param"}
        forward = []
        for node in program.graph.nodes:
            if node.op == "call_function" and node.meta.get("role") in ("forward", "loss"):
                forward.append(node)
            if node is loss:
                break
        outputs = dict(zip(program.outputs, output_values(program)))
        losses = [loss]
        for m in range(TRIALS):
            coefficient = -_f32(self.o.rho**m)
            env: dict = {g: self.op(aten.mul.Tensor, dn[g], coefficient) for g in self.grads}
            self.cursor.copy(self.update, env, f"trial{m}_", trial=m)
            weights = {params[name]: env[outputs[Port("param", name)]] for name in params}
            for value in _private_inputs(forward) - weights.keys():  # BatchNorm's running statistics
                weights[value] = self.cursor.emit(aten.clone.default, (value,), role="forward", trial=m)
            env = self.cursor.copy(forward, weights, f"trial{m}_", trial=m)
            losses.append(env[loss])
        return losses

    def _line_search(self, losses: list[fx.Node], gkdk: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
        """Rank-averaged losses (one all-reduce), the Armijo tests, and the chosen ``rho`` and ``find``."""
        program, world = self.program, self.program.world_size
        as_f32 = [self.op(aten._to_copy.default, x, dtype=F32) for x in losses]
        stacked = self.op(aten.stack.default, [self.op(aten.view.default, x, []) for x in as_f32])
        if world > 1:
            info = {"kind": "all_reduce", "dim_reduce": ("loss", "trial losses"), "bytes": 4 * len(losses)}
            total = self.comm(C10D.all_reduce_.default, (stacked, "sum", program.group_name), info)
            stacked = self.op(aten.div.Tensor, total, float(world))
        old = self.op(aten.select.int, stacked, 0, 0)
        passed = []
        for m in range(TRIALS):
            slope = self.op(aten.mul.Tensor, gkdk, _f32(self.o.sigma) * _f32(self.o.rho**m))
            bound = self.op(aten.add.Tensor, old, slope)
            passed.append(self.op(aten.lt.Tensor, self.op(aten.select.int, stacked, 0, m + 1), bound))
        device = {"dtype": F32, "device": stacked.meta["val"].device}
        rho = self.op(aten.scalar_tensor.default, 0.0, **device)
        for m in reversed(range(TRIALS)):  # the first trial that passes wins
            value = self.op(aten.scalar_tensor.default, _f32(self.o.rho**m), **device)
            rho = self.op(aten.where.self, passed[m], value, rho)
        find = self.op(aten.logical_or.default, passed[0], passed[1])
        return old, rho, find
