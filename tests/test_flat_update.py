"""``flatten-update``: one optimizer update per bucket on flat parameters and state (``passes/flatten_update.py``,
``runtime/flat_storage.py``), single-process. The worlds of ``test_parity.py`` and ``test_zero.py`` hold the flat
programs to DDP at W=2 and W=4; here each step is held to eager ``optimizer.step()`` (the for-loop), bitwise,
and what a user does to parameters and optimizer state between steps is done to both."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bench.tiny_models import Lamb, Lion, TiedLM, make_batch
from passes.flatten_update import FlattenUpdate
from tests.helpers import assert_same_training_state, eager_step
from transpiler import Clipping, LocalSGD, LossScaling, PassPipeline, StaticWorld, mode_config, transpile
from transpiler.errors import ConfigurationError, UnsupportedOptimizerError
from transpiler.graph.ports import Port
from transpiler.graph.views import is_view

LOSS = nn.CrossEntropyLoss()
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3, foreach=False),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=False),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=False),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, foreach=False),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
}


def mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def pair(model: nn.Module, make_opt, batch, **options):
    """The transpiled step (W=1) and an eager twin of the same model and optimizer."""
    twin = copy.deepcopy(model)
    optimizer, twin_opt = make_opt(model), make_opt(twin)
    step = transpile(
        model, optimizer, mode_config("fused_allreduce", **options), LOSS, batch, mesh=StaticWorld(size=1, rank=0)
    )
    return (model, optimizer, step), (twin, twin_opt)


def train(flat, eager, batch, steps: int) -> None:
    (model, optimizer, step), (twin, twin_opt) = flat, eager
    for _ in range(steps):
        loss = step(*batch)
        assert torch.equal(loss, eager_step(twin, twin_opt, LOSS, batch))
    assert_same_training_state(model, optimizer, twin, twin_opt)


def flat_names(step, kind: str) -> list[str]:
    return [name for b in step.program.flat_buffers if b.kind == kind for name in b.names]


@pytest.mark.bitwise
@settings(max_examples=20, deadline=None)
@given(
    widths=st.lists(st.integers(1, 37), min_size=2, max_size=5),
    name=st.sampled_from(sorted(OPTIMIZERS)),
    seed=st.integers(0, 2**16),
)
def test_each_element_gets_eager_bits_whatever_the_sizes(widths, name, seed):
    """Odd sizes put each parameter's last elements where the per-parameter kernel runs its scalar tail and the
    flat one its vectorised body; the slots start aligned (graph/bucket_layout.py). Every optimizer whose update
    is element-wise is flattened (its own step() traced, for all but SGD, Adam and AdamW) and keeps eager's bits
    for three steps."""
    torch.manual_seed(seed)
    model = mlp([*widths, 3])
    batch = (torch.randn(5, widths[0]), torch.randint(0, 3, (5,)))
    flat, eager = pair(model, lambda m: OPTIMIZERS[name](m.parameters()), batch)
    train(flat, eager, batch, 3)
    step = flat[2]
    assert sorted(flat_names(step, "param")) == sorted(n for n, _ in model.named_parameters())
    assert not [p for p in step.program.inputs if p.kind in ("param", "state")]


def gpt_pair(blocks: int):
    from bench.models import NarrowGPT, narrow_batch

    torch.manual_seed(0)
    model = NarrowGPT(blocks=blocks)
    batch = narrow_batch("gpt", 2, torch.Generator().manual_seed(0))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]

    def make(m):
        by_id = {id(p): q for p, q in zip(model.parameters(), m.parameters())}
        groups = [
            {"params": [by_id[id(p)] for p in decay], "weight_decay": 0.1},
            {"params": [by_id[id(p)] for p in rest]},
        ]
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0, foreach=False)

    return pair(model, make, batch), batch


def test_the_update_is_one_chain_per_param_group_whatever_the_number_of_parameters():
    """A GPT's AdamW with weight decay on its matrices only: the bucket lays each group's parameters out together,
    and the update is one chain per group (two here). 4 blocks or 12: the same update ops; the per-parameter
    inputs and outputs are gone, every parameter has one slot."""
    counts = []
    for blocks in (4, 12):
        (flat, eager), batch = gpt_pair(blocks)
        train(flat, eager, batch, 2)
        step = flat[2]
        update = [n for n in step.program.graph.nodes if n.op == "call_function" and n.meta.get("role") == "optimizer"]
        counts.append(len(update))
        names = flat_names(step, "param")
        assert sorted(names) == sorted(n for n, _ in flat[0].named_parameters()) and len(set(names)) == len(names)
        runs = {b.port.rsplit(".", 1)[0] for b in step.program.flat_buffers if b.kind == "state"}
        assert len(runs) == 2, runs
    assert counts[0] == counts[1]


class TiedFrozenMixed(nn.Module):
    """Tied embedding and output weights, a frozen layer, and a float64 layer beside the float32 ones."""

    def __init__(self):
        super().__init__()
        self.lm = TiedLM()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.extra = nn.Linear(4, 4).double()

    def forward(self, tokens):
        side = self.frozen(self.extra(torch.ones(2, 4, dtype=torch.float64)).float()).sum()
        return self.lm(tokens) + 1e-3 * side


@pytest.mark.quick
def test_frozen_tied_and_mixed_dtypes():
    """A frozen layer stays out (its own input, no update); the tied embedding has one slot; the float64 layer
    gets a bucket of its own, flat as well. Bitwise eager with AdamW."""
    torch.manual_seed(1)
    model = TiedFrozenMixed()
    batch = make_batch("tied", 8, torch.Generator().manual_seed(1))
    flat, eager = pair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False), batch)
    train(flat, eager, batch, 3)
    step = flat[2]
    assert {b.dtype for b in step.program.flat_buffers if b.kind == "param"} == {"float32", "float64"}
    names = flat_names(step, "param")
    assert "frozen.weight" not in names and Port("frozen", "frozen.weight") in step.program.inputs
    assert names.count("lm.embed.weight") == 1 and "lm.proj.weight" not in names


def test_bfloat16_add_with_alpha_stays_per_parameter():
    """bfloat16 ``add(..., alpha=)`` (SGD's weight decay) rounds differently in a flat kernel's vectorised body than
    in a small tensor's scalar tail (docs/bitwise.md): the bucket stays per parameter, ``decisions`` says why, and
    the step is the one without ``flatten-update``, bit for bit (the SGD twin is not eager's bits in bfloat16,
    with or without it: its ``addcmul`` by a float64 scalar rounds once where eager's ``add`` rounds twice)."""
    torch.manual_seed(2)
    model = mlp([6, 5, 3]).bfloat16()
    batch = (torch.randn(4, 6).bfloat16(), torch.randint(0, 3, (4,)))
    twin = copy.deepcopy(model)
    steps = []
    reference = PassPipeline(spec="scale-loss-grad,fuse-allreduce,reinplace-optimizer")
    for m, spec in ((model, "fused_allreduce"), (twin, reference)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=1e-2, foreach=False)
        steps.append(transpile(m, optimizer, spec, LOSS, batch, mesh=StaticWorld(size=1, rank=0)))
    for _ in range(2):
        assert torch.equal(steps[0](*batch), steps[1](*batch))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert not steps[0].program.flat_buffers
    assert "rounds differently" in steps[0].program.decisions["flatten-update"]


def test_a_whole_tensor_norm_stays_per_parameter():
    """LAMB's trust ratio needs each whole tensor's norm: its bucket stays per parameter, ``decisions`` says
    which op, and the step is eager's, bitwise."""
    torch.manual_seed(2)
    model = mlp([6, 5, 3])
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    flat, eager = pair(model, lambda m: Lamb(m.parameters()), batch)
    train(flat, eager, batch, 2)
    assert not flat[2].program.flat_buffers
    assert "linalg_vector_norm" in flat[2].program.decisions["flatten-update"]


def adam_pair():
    torch.manual_seed(3)
    model = mlp([7, 9, 3])
    batch = (torch.randn(6, 7), torch.randint(0, 3, (6,)))
    return pair(model, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False), batch), batch


def test_what_users_do_between_steps_is_taken_into_the_flat_buffers():
    """``p.data = ...``, an in-place edit, ``optimizer.load_state_dict()`` and ``optimizer.state.clear()`` between
    steps, done to the step's model and to an eager twin alike: training goes on bitwise, and the parameters and
    state are views of the flat buffers again (the next step copied the new tensors in)."""
    (flat, eager), batch = adam_pair()
    (model, optimizer, step), (twin, twin_opt) = flat, eager
    train(flat, eager, batch, 2)
    saved = copy.deepcopy(twin_opt.state_dict())
    for m in (model, twin):
        first = next(m.parameters())
        first.data = first.data * 0.5
    train(flat, eager, batch, 1)
    for m in (model, twin):
        with torch.no_grad():
            next(m.parameters()).mul_(0.25)
    train(flat, eager, batch, 1)
    for opt in (optimizer, twin_opt):
        opt.load_state_dict(copy.deepcopy(saved))
    train(flat, eager, batch, 1)
    for opt in (optimizer, twin_opt):
        opt.state.clear()  # eager starts its state again
    train(flat, eager, batch, 2)
    buffers = step._state.flat.buffers
    storages = {t.untyped_storage().data_ptr() for t in buffers.values()}
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= storages
    assert {t.untyped_storage().data_ptr() for s in optimizer.state.values() for t in s.values()} <= storages


@pytest.mark.quick
def test_a_changed_dtype_or_uneven_step_counts_are_clear_errors():
    (flat, eager), batch = adam_pair()
    model, optimizer, step = flat
    train(flat, eager, batch, 1)
    first = next(model.parameters())
    with torch.no_grad():
        optimizer.state[first]["step"].fill_(7.0)  # one parameter's count edited in place
    with pytest.raises(UnsupportedOptimizerError, match="different step counts"):
        step(*batch)
    with torch.no_grad():
        optimizer.state[first]["step"].fill_(1.0)
    model.double()
    with pytest.raises(ConfigurationError, match="transpile\\(\\) again"):
        step(batch[0].double(), batch[1])


def test_a_checkpoint_of_the_flat_step_resumes_bitwise():
    """``step.state_dict()`` holds views of the flat buffers; saved and loaded into a new step, training resumes
    where the uninterrupted run goes."""
    (flat, eager), batch = adam_pair()
    train(flat, eager, batch, 2)
    saved = flat[2].state_dict()
    (fresh, _), _ = adam_pair()
    fresh[2].load_state_dict(copy.deepcopy(saved))
    for _ in range(2):
        assert torch.equal(fresh[2](*batch), flat[2](*batch))
    assert_same_training_state(fresh[0], fresh[1], flat[0], flat[1])


UNFLATTENED = {  # each mode's pipeline without flatten-update: the reference its flat program must equal
    ("allreduce", ()): "broadcast-params,scale-loss-grad,allreduce-grads,reinplace-optimizer",
    ("fused_allreduce", (("clipping", Clipping(max_norm=0.5)),)): (
        "broadcast-params,scale-loss-grad,fuse-allreduce,clip-grad-norm{max-norm=0.5},reinplace-optimizer"
    ),
    (
        "fused_allreduce",
        (("loss_scaling", LossScaling()),),
    ): "broadcast-params,scale-loss-grad,fuse-allreduce,loss-scale,reinplace-optimizer",
    ("adasum", ()): "broadcast-params,adasum,reinplace-optimizer",
}


@pytest.mark.parametrize("mode,options", list(UNFLATTENED), ids=lambda v: str(v))
def test_other_modes_are_flat_and_compute_what_they_did(mode, options):
    """``allreduce`` (its gradients laid out in a buffer first), clipping (one norm op for all gradients, the
    clipped update flat), loss scaling (one all-finite check per run) and AdaSum are flat too, and bit for bit
    what the same pipeline without ``flatten-update`` computes, for four steps with AdamW."""
    results = []
    for spec, opts in ((mode, dict(options)), (UNFLATTENED[(mode, options)], {})):
        torch.manual_seed(4)
        model = mlp([11, 13, 3])
        batch = (torch.randn(6, 11), torch.randint(0, 3, (6,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        config = PassPipeline(spec=spec) if "," in spec else mode_config(spec, **opts)
        step = transpile(model, optimizer, config, LOSS, batch, mesh=StaticWorld(size=1, rank=0))
        losses = [step(*batch) for _ in range(4)]
        results.append((model, optimizer, step, losses))
    (flat_model, flat_opt, flat_step, flat_losses), (model, opt, _, losses) = results
    assert flat_step.program.flat_buffers and "flatten-update" not in flat_step.program.decisions
    assert all(torch.equal(a, b) for a, b in zip(flat_losses, losses))
    assert_same_training_state(flat_model, flat_opt, model, opt)


LOCAL_SGD_OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    # the generic path: the first step creates the state (a per-parameter program), the later ones are flat
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True, foreach=False),
}


@pytest.mark.parametrize("make", list(LOCAL_SGD_OPTIMIZERS.values()), ids=list(LOCAL_SGD_OPTIMIZERS))
def test_local_sgd_is_flat_in_both_variants_with_one_layout(make, monkeypatch):
    """LocalSGD's local and sync programs are flat with the same parameter buffer (the parameters stay where
    they are from one variant to the other), the sync program's snapshot is one flat buffer whose views are the
    per-parameter snapshots checkpoints hold, and k=2 over six steps is what the per-parameter programs compute,
    bit for bit (the same ``snapshot - (snapshot - p') / W`` per element)."""
    runs = []
    for flat in (True, False):
        if not flat:  # the reference: the same strategy with flatten-update doing nothing
            monkeypatch.setattr(FlattenUpdate, "run", lambda self, program: False)
        torch.manual_seed(5)
        model = mlp([9, 7, 3])
        batch = (torch.randn(6, 9), torch.randint(0, 3, (6,)))
        optimizer = make(model.parameters())
        step = transpile(
            model, optimizer, LocalSGD(adaptive=False, k_steps=2), LOSS, batch, mesh=StaticWorld(size=1, rank=0)
        )
        losses, pointers = [], []
        for _ in range(6):
            losses.append(step(*batch))
            pointers.append([p.data_ptr() for p in model.parameters()])
        runs.append((model, optimizer, step, losses, pointers))
    (model, optimizer, step, losses, pointers), (plain, plain_opt, plain_step, plain_losses, _) = runs
    local, sync = step.programs["local"], step.programs["sync"]
    assert local.flat_buffers and sync.flat_buffers[: len(local.flat_buffers)] == local.flat_buffers
    assert [b.kind for b in sync.flat_buffers[len(local.flat_buffers) :]] == ["extra"]
    assert pointers[1:] == pointers[2:] + pointers[-1:], "from the second step, the parameters never move"
    assert not plain_step.programs["sync"].flat_buffers
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert_same_training_state(model, optimizer, plain, plain_opt)
    ours, theirs = step.state_dict()["transpiler"]["extra"], plain_step.state_dict()["transpiler"]["extra"]
    assert sorted(ours) == sorted(theirs) == sorted(f"snapshot.{n}" for n, _ in model.named_parameters())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_zero3s_flat_update_runs_in_place():
    """zero3's AdamW, once per bucket on this rank's flat shard, writes the parameters and state in place, as
    eager's foreach AdamW does (``reinplace-optimizer``): the new tensors are the square root of ``exp_avg_sq``,
    one per bucket, and the step size as ``addcdiv``'s value (one float64 for every bucket, ``fold_step_size.py``;
    until then ``exp_avg`` times the step size, one per bucket too), so at W=2 the program's own peak is 1.25 times the
    parameter bytes (3.0 when every multi-tensor op allocated its results, 6.0 at W=1: 1.6x FSDP2's peak on an
    H200)."""
    from transpiler.graph.memory import peak_transient_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    batch = (torch.randn(2, 256), torch.randint(0, 256, (2,)))
    step = transpile(
        model, torch.optim.AdamW(model.parameters()), "zero3", nn.CrossEntropyLoss(), batch, mesh=StaticWorld(size=2)
    )
    made = sorted(
        str(n.target)
        for n in step.program.graph.nodes
        if n.op == "call_function"
        and n.meta.get("role") == "optimizer"
        and not is_view(n)
        and not n.target._schema.is_mutable
    )
    buckets = len(step.program.param_buckets)
    assert buckets == 4 and made == ["aten.repeat.default"] + ["aten.sqrt.default"] * buckets, made
    assert peak_transient_bytes(step.program.graph) <= 1.3 * param_bytes
