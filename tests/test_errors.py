"""Bad input gets a typed error that says what was wrong and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transpiler import (
    ConfigurationError,
    DataParallel,
    PassPipeline,
    PipelineSpecError,
    StaticWorld,
    UnsupportedModelError,
    UnsupportedOptimizerError,
    VerificationError,
    mode_config,
    transpile,
)
from transpiler.cli import main as cli_main

pytestmark = pytest.mark.quick  # the quick tier: 2 s

BATCH = (torch.randn(4, 3), torch.randint(0, 2, (4,)))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: torch.optim.LBFGS(p), "closure"),
        (lambda p: torch.optim.SparseAdam(p), "sparse gradients"),
    ],
    ids=["LBFGS", "SparseAdam"],
)
def test_optimizers_one_step_graph_cannot_hold_are_refused_with_the_reason(make, why):
    model = nn.Linear(3, 2)
    with pytest.raises(UnsupportedOptimizerError, match=why):
        transpile(model, make(model.parameters()), loss_fn=nn.CrossEntropyLoss(), example_inputs=BATCH)


def test_optimizer_step_hooks_are_refused_not_skipped():
    model = nn.Linear(3, 2)
    opt = torch.optim.RMSprop(model.parameters())
    opt.register_step_post_hook(lambda *args: None)
    with pytest.raises(UnsupportedOptimizerError, match="step hooks"):
        transpile(model, opt, loss_fn=nn.CrossEntropyLoss(), example_inputs=BATCH)


def test_data_dependent_control_flow():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else -self.lin(x)

    model = Branchy()
    with pytest.raises(UnsupportedModelError, match="data-dependent control flow"):
        transpile(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(), example_inputs=BATCH
        )


def test_no_trainable_parameters():
    model = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ConfigurationError, match="no trainable parameters"):
        transpile(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(), example_inputs=BATCH
        )


def test_world_size_above_one_without_process_group_can_be_inspected_not_run():
    model = nn.Linear(3, 2)
    step = transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.CrossEntropyLoss(),
        example_inputs=BATCH,
        mesh=StaticWorld(size=2, rank=1),
    )
    assert "all_reduce" in step.graph_module.code
    with pytest.raises(ConfigurationError, match="init_process_group"):
        step(*BATCH)


@pytest.mark.parametrize(
    "mode, error, message",
    [
        ("allreduc", ConfigurationError, "unknown mode 'allreduc'"),
        ("scale-loss-grad,no-such-pass", PipelineSpecError, "unknown pass 'no-such-pass'"),
        (
            "fuse-allreduce{bucket-cap-mb=big}",
            PipelineSpecError,
            "bucket-cap-mb.*wants a finite float >= 0 or 'auto'; got 'big'",
        ),
        ("fuse-allreduce{bucket-cap-mb=-1}", PipelineSpecError, "bucket-cap-mb.*too small"),
        ("fuse-allreduce{size=3}", PipelineSpecError, "no option.*'size'.*bucket-cap-mb"),
        # passes in an order that cannot work, refused before anything is traced, naming both passes
        (
            "gather-params,shard-optimizer",
            PipelineSpecError,
            "'gather-params' requires the optimizer state sharded.*'shard-optimizer' ensures it, but later",
        ),
        (
            "reinplace-optimizer,fuse-allreduce",
            PipelineSpecError,
            "'fuse-allreduce' requires a functional graph.*'reinplace-optimizer' before it takes that away",
        ),
        (
            "fuse-allreduce,clip-grad-norm,loss-scale",
            PipelineSpecError,
            "'loss-scale' requires gradients as reduced, not yet unscaled.*put loss-scale before clip-grad-norm",
        ),
        ("foreach-update,flatten-update", PipelineSpecError, "put flatten-update before foreach-update"),
        ("allreduce-grads,fuse-allreduce", PipelineSpecError, "'fuse-allreduce' requires the backward's gradients"),
        ("dim-reduce", PipelineSpecError, "requires gradients reduced across ranks; and no pass before it ensures"),
    ],
)
def test_bad_mode_or_spec(mode, error, message):
    """A mode's name, or a pipeline of passes: an error when the config is made, before anything is traced."""
    model = nn.Linear(3, 2)
    with pytest.raises(error, match=message):
        config = PassPipeline(spec=mode) if "-" in mode else mode_config(mode)  # a pass's name has a dash
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), config, loss_fn=nn.CrossEntropyLoss())


def test_unknown_mode_option():
    model = nn.Linear(3, 2)
    with pytest.raises(ConfigurationError, match="bucket_cap_mb"):
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), DataParallel(fused=False, bucket_cap_mb=4))


def test_loss_must_be_a_scalar():
    model = nn.Linear(3, 2)
    with pytest.raises(UnsupportedModelError, match="one element"):
        transpile(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.CrossEntropyLoss(reduction="none"),
            example_inputs=BATCH,
        )


def test_changed_hyper_parameter_asks_for_a_new_transpile():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(model, opt, loss_fn=nn.CrossEntropyLoss(), example_inputs=BATCH)
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(UnsupportedOptimizerError, match="transpile\\(\\) again"):
        step(*BATCH)


def test_a_pass_that_breaks_an_invariant_is_named():
    """allreduce-grads after fuse-allreduce finds nothing left; a second reduction is caught by the verifier."""
    from passes.allreduce_grads import AllReduceGrads
    from transpiler.build import rewrite
    from transpiler.graph.pipeline import Fact
    from transpiler.runtime.process_group import Placement
    from transpiler.trace.tracer import trace_step

    class ReduceAgain(AllReduceGrads):
        name = "reduce-again"
        requires = frozenset({Fact.FUNCTIONAL})  # it claims to need nothing: only the verifier can catch it

        def run(self, program):
            for node in program.graph.nodes:  # pretend every gradient is still unreduced
                node.meta.pop("bucket", None)
            changed = False
            for grad in [n for n in program.graph.nodes if "grad_of" in n.meta]:
                waited = next(u for u in grad.users if u.meta.get("role") == "communication")
                waited.meta["grad_of"], grad.meta["grad_of"] = grad.meta.pop("grad_of"), None
                changed = True
            super().run(program)
            return changed

    model = nn.Linear(3, 2)
    traced = trace_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), BATCH)[0].program
    from passes import PASSES

    with pytest.raises(VerificationError, match="reduce-again.*allreduce-grads"):
        rewrite(traced, [PASSES["allreduce-grads"](), ReduceAgain()], Placement(2, 0, "world", False))


def test_cli_reports_a_failing_factory_plainly(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def make():\n    raise RuntimeError('no data here')\n")
    assert cli_main(["dump", f"{bad}:make"]) == 2
    err = capsys.readouterr().err
    assert "make() in" in err and "RuntimeError: no data here" in err and "Traceback" not in err
    assert cli_main(["dump", f"{tmp_path}/missing.py:make"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_allgather_refuses_an_optimizer_without_a_twin_at_transpile():
    model = nn.Linear(3, 2)
    with pytest.raises(ConfigurationError, match="allgather.*RMSprop has none"):
        transpile(
            model,
            torch.optim.RMSprop(model.parameters()),
            "allgather",
            nn.CrossEntropyLoss(),
            mesh=StaticWorld(size=2, rank=0),
        )


def test_an_optimizer_whose_step_fails_while_traced_is_named():
    class Fragile(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad.numpy().sum())  # leaves torch: cannot be traced

    model = nn.Linear(3, 2)
    with pytest.raises(UnsupportedOptimizerError, match=r"Fragile.step\(\) failed while the step was traced"):
        transpile(model, Fragile(model.parameters()), loss_fn=nn.CrossEntropyLoss(), example_inputs=BATCH)
