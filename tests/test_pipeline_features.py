"""Pipeline parallelism beyond the schedules' parity (tests/test_pipeline.py): interleaved 1F1B against torch's
``ScheduleInterleaved1F1B`` and accumulation, bitwise; clipping by the whole model's norm against
``clip_grad_norm_`` after accumulation, bitwise; a stage resumed from its ``step.state_dict()``, bitwise, and
another stage's snapshot refused; DCP checkpoints refused; compiled stages (``compile=True``) within 1e-5 of the
eager run. A file of its own so that the suite's workers share the pipeline's worlds.

Cost (2-core AMD EPYC, one process): interleaved 24 s, compiled stages 30-60 s, clipping 15 s, resuming 20 s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.pipeline_worker import base_model
from tests.worlds import run_in_world
from transpiler import ConfigurationError, PipelineParallel, StaticWorld, transpile


@pytest.mark.timeout(300)
def test_interleaved_1f1b_equals_torchs_and_accumulation_bitwise(tmp_path):
    """Two ranks, two chunks each (``interleaved_1f1b``, ``virtual_stages=2``: blocks 0 and 2 on rank 0), 6
    microbatches: the rank's parameters after 10 AdamW steps and the losses are bitwise those of torch's
    ``ScheduleInterleaved1F1B`` over a ``PipelineStage`` per chunk, and of one process accumulating the same
    microbatches (each chunk's gradients add in microbatch order under both). About 20 s."""
    ranks = run_in_world(2, "tests.pipeline_worker:interleaved", tmp_path, (6,), timeout=200)
    last = ranks[-1]["torch"]["losses"]
    assert len(last) == 10
    for rank, runs in enumerate(ranks):
        assert "chunks" in runs["order"]["split-stages"] and f".c{2 + rank}" in runs["order"]["split-stages"]
        held = set(runs["torch"]["params"])
        assert {f"blocks.{rank}.qkv.weight", f"blocks.{rank + 2}.qkv.weight"} <= held, held
        for name in ("traced", "accumulated"):
            for param, value in runs["torch"]["params"].items():
                assert torch.equal(runs[name]["params"][param], value), f"rank {rank}, {name}: '{param}' differs"
            assert runs[name]["losses"] == last, f"rank {rank}, {name}: losses"


@pytest.mark.timeout(600)
def test_compiled_stages_keep_the_schedules_order_and_follow_the_eager_run(tmp_path):
    """``compile=True``: each stage's program compiles once (one graph), runs without waiting forever (each
    message reads the one before it, so Inductor keeps their order; it hoisted every receive to the start before),
    and follows the eager run: 6 steps of SGD with momentum on a 2-block GPT within 1e-5 (Inductor fuses
    element-wise ops and rounds otherwise). 30-60 s."""
    ranks = run_in_world(2, "tests.pipeline_worker:compiled", tmp_path, (2,), timeout=500)
    for rank, runs in enumerate(ranks):
        eager, compiled = runs["eager"], runs["compiled"]
        assert compiled["graphs"] == 1 and compiled["compile_seconds"]["step"] > 0, (rank, compiled["graphs"])
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        for param, value in eager["params"].items():
            got = compiled["params"][param]
            where = f"rank {rank}, {param}"
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.timeout(300)
def test_clipping_by_the_whole_models_norm_equals_clip_grad_norm_after_accumulation_bitwise(tmp_path):
    """Two stages, 1F1B, every step clipped (``Clipping(max_norm=0.2)``): each stage's gradient norms meet in model
    order over the pipeline's group, so the norm each stage reports and clips by is ``clip_grad_norm_``'s over the
    whole model in one process accumulating the same microbatches, bit for bit, and so are the parameters after 10
    AdamW steps (a world of 2, about 10 s)."""
    ranks = run_in_world(2, "tests.pipeline_worker:clipped", tmp_path, (3,), timeout=200)
    for rank, runs in enumerate(ranks):
        traced, reference = runs["traced"], runs["accumulated"]
        assert all(n > 0.2 for n in reference["norms"]), "every step clips"
        assert traced["norms"] == reference["norms"], f"stage {rank}: norms {traced['norms']}"
        assert traced["losses"] == reference["losses"], f"stage {rank}: losses {traced['losses']}"
        for param, value in reference["params"].items():
            assert torch.equal(traced["params"][param], value), f"stage {rank}: '{param}' differs"


@pytest.mark.timeout(300)
def test_a_stage_resumes_from_its_snapshot_bitwise_and_refuses_another_stages(tmp_path):
    """Two stages, 1F1B: 5 steps, ``step.state_dict()`` through ``torch.save``, and a step made from another
    initialisation that loads it and runs 5 more equals 10 steps straight, losses and the stage's parameters bit
    for bit (AdamW's moments and step counts came back). A snapshot holds the stage's entries only; the other
    stage's is refused naming the stage (a world of 2, about 15 s)."""
    ranks = run_in_world(2, "tests.pipeline_worker:resumed", tmp_path, (3,), timeout=200)
    model = base_model()
    for rank, out in enumerate(ranks):
        straight, resumed = out["straight"], out["resumed"]
        assert resumed["losses"] == straight["losses"], f"stage {rank}"
        for param, value in straight["params"].items():
            assert torch.equal(resumed["params"][param], value), f"stage {rank}: '{param}' differs"
        mine = set(straight["params"])
        others = {n for n, _ in model.named_parameters()} - mine
        assert mine <= set(out["entries"]) and not others & set(out["entries"]), out["entries"]
        assert out["optimizer state"] == len(mine)
        error = out["other stage's"]
        assert error is not None and f"pipeline stage: checkpoint '{1 - rank} of 2', this step '{rank} of 2'" in error


def test_dcp_checkpoints_of_a_stage_are_refused_until_built():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    step = transpile(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "none", nn.functional.mse_loss,
        (torch.randn(4, 4), torch.randn(4, 4)), mesh=StaticWorld(size=2, rank=1),
        pipeline=PipelineParallel(stages=2, microbatches=2),
    )  # fmt: skip
    for call in (lambda: step.save_checkpoint("unused"), lambda: step.load_checkpoint("unused")):
        with pytest.raises(ConfigurationError, match=r"is not built for a pipeline yet.*step.state_dict\(\)"):
            call()
