"""The GPU lane: a world of one over NCCL on one CUDA device (skipped without CUDA, so CI stays green).

Run on a GPU machine with the project on the path: ``PYTHONPATH=$PWD python3 -m pytest -m gpu -s``.
Each check prints what it measured (``GPU <name>: ...``), so a run is also the record of the tolerances.
What one GPU cannot show (several ranks over NCCL) is argued in docs/gpu.md.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bench.harness.launch import free_port
from bench.tiny_models import make_batch, make_model
from tests.demo_worker import DEMO
from tests.helpers import eager_step, exchange_ops_run, state_addresses
from transpiler import Accumulation, Clipping, DiLoCo, Execution, LossScaling, mode_config, transpile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEVICE = torch.device("cuda", 0)
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.01),  # DeMo's: SGD without momentum
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
}


@pytest.fixture(scope="module", autouse=True)
def nccl_world_of_one():
    """Every collective of the programs really runs, through NCCL; the environment is restored afterwards."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MASTER_ADDR", os.environ.get("MASTER_ADDR", "127.0.0.1"))
        env.setenv("MASTER_PORT", str(free_port()))
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=120), device_id=DEVICE)
        yield
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def restore_tf32():
    """Tests turn TF32 off for fp32 comparisons; what follows them gets torch's settings back."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _train_both(model_name, opt_name, mode, autocast, steps=5, execution=None, **options) -> tuple[float, float]:
    """Largest differences (parameters, loss) between the transpiled step and eager over ``steps`` steps."""
    torch.manual_seed(0)
    model = make_model(model_name).to(DEVICE)
    ref = copy.deepcopy(model)
    optimizer, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    loss_fn = nn.CrossEntropyLoss()
    step = transpile(model, optimizer, mode_config(mode, **options), loss_fn, execution=execution)
    gen = torch.Generator().manual_seed(1)
    worst_param = worst_loss = 0.0
    for _ in range(steps):
        batch = tuple(t.to(DEVICE) for t in make_batch(model_name, 16, gen))
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = step(*batch)
        expected = eager_step(ref, ref_opt, loss_fn, batch, ("cuda", autocast))
        worst_loss = max(worst_loss, (loss - expected).abs().item())
        with step.gathered():  # zero3's parameters are slices between steps; a no-op in the other modes
            worst_param = max(
                worst_param, *((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
            )
    print(f"GPU {model_name} {opt_name} {mode} autocast={autocast}: param {worst_param:.3g}, loss {worst_loss:.3g}")
    return worst_param, worst_loss


@pytest.mark.parametrize(
    "mode", ["none", "allreduce", "fused_allreduce", "local_sgd", "adasum", "zero1", "zero2", "zero3"]
)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fp32_every_single_rank_mode_follows_eager(mode, opt_name):
    """fp32 (no TF32), against eager's single-tensor path. Not bitwise on CUDA: the per-step scalars are 0-d
    tensors (so a compiled or captured program serves every step), and CUDA's ``add(alpha=)`` and
    ``addcdiv(value=)`` fuse the scalar into one rounding where ``addcmul`` by a tensor rounds the product
    first (on the CPU the same forms are bitwise, tests/test_tracing.py). One ulp of an update per step."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    param, loss = _train_both("mlp", opt_name, mode, None)
    assert param <= 1e-6 and loss <= 1e-6


def test_zero3_prefetches_the_next_bucket_on_the_gpu():
    """On CUDA (NCCL) zero3 issues the next bucket's all-gather before the current bucket's compute, so the two
    overlap (on the CPU every all-gather runs alone); and it still follows eager."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    caps = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001}
    param, loss = _train_both("mlp", "sgd", "zero3", None, **caps)
    assert param <= 1e-6 and loss <= 1e-6
    model = make_model("mlp").to(DEVICE)
    batch = tuple(t.to(DEVICE) for t in make_batch("mlp", 16, torch.Generator().manual_seed(1)))
    step = transpile(
        model, OPTIMIZERS["sgd"](model.parameters()), mode_config("zero3", **caps), nn.CrossEntropyLoss(), batch
    )
    nodes = list(step.program.graph.nodes)
    overlapped = 0
    for i, node in enumerate(nodes):
        if node.meta.get("collective", {}).get("kind") == "all_gather":
            wait = next(u for u in node.users if u.target is torch.ops._c10d_functional.wait_tensor.default)
            between = nodes[i + 1 : nodes.index(wait)]
            overlapped += any(n.meta.get("role") in ("forward", "backward") for n in between)
    assert overlapped >= 2, overlapped


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_zero3_prefetch_depth_is_the_gathers_in_flight_during_compute(prefetch):
    """``prefetch=k``: while the forward or backward computes, at most k all-gathers are in flight beyond the
    bucket being read, and k of them somewhere (0: each gather is issued where its bucket is needed)."""
    caps = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001, "prefetch": prefetch}
    model = make_model("mlp").to(DEVICE)
    batch = tuple(t.to(DEVICE) for t in make_batch("mlp", 16, torch.Generator().manual_seed(1)))
    step = transpile(
        model, OPTIMIZERS["sgd"](model.parameters()), mode_config("zero3", **caps), nn.CrossEntropyLoss(), batch
    )
    in_flight, most = set(), 0
    for node in step.program.graph.nodes:
        if node.meta.get("collective", {}).get("kind") == "all_gather":
            in_flight.add(node)
        elif node.target is torch.ops._c10d_functional.wait_tensor.default:
            in_flight.discard(node.args[0])
        elif node.meta.get("role") in ("forward", "backward"):
            most = max(most, len(in_flight))
    assert most == prefetch, most


def test_a_foreach_operand_in_the_tensors_dtype_keeps_the_bits_in_one_kernel():
    """foreach-update casts the per-step float64 scalars to the tensors' dtype on a GPU (passes/foreach_update.py):
    the multi-tensor kernel then runs once, not once per tensor, and computes the same bits."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    sizes = (1, 7, 1000, 4099, 65537)
    xs = [torch.randn(n, device=DEVICE, generator=gen) for n in sizes]
    scalar = torch.tensor(0.1234567890123, dtype=torch.float64, device=DEVICE)
    for op in (torch._foreach_mul, torch._foreach_div):
        kernels, results = [], []
        for operand in (scalar, scalar.float()):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                results.append(op(xs, operand))
                torch.cuda.synchronize()
            kernels.append(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
        print(f"GPU {op.__name__}: kernels with a float64 / float32 operand {kernels}")
        assert kernels[1] < kernels[0], kernels


def test_adamw_against_eager_foreach_within_rounding():
    """Eager takes the foreach path on CUDA by default, which rounds Adam's update in another order."""
    param, _ = _train_both("mlp", "adamw_foreach", "fused_allreduce", None)
    assert param <= 1e-5


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_bf16_autocast_around_the_step_follows_eager_autocast(model_name):
    """Bitwise, as docs/gpu.md says (measured 0 on an H100): the graph holds eager autocast's casts."""
    param, loss = _train_both(model_name, "sgd", "fused_allreduce", torch.bfloat16)
    assert param == 0 and loss == 0


def test_compile_with_adamw_compiles_once_over_30_steps():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    param, _ = _train_both("mlp", "adamw", "fused_allreduce", None, steps=30, execution=Execution(compile=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert param <= 1e-5


@pytest.mark.parametrize("mode", ["demo", "sparseloco"])
def test_the_compiled_sparse_exchange_runs_inside_inductors_program_and_follows_the_uncompiled_step(mode):
    """compile=True calls the exchange's top-k, packing and decoding inline (issue 77; on the CPU since ff9b1ad,
    written without a GPU to run it on): on CUDA too no opaque exchange op runs in a compiled step, and 6 steps
    stay within 1e-5 of the uncompiled ones (DeMo: SGD on the sign; SparseLoCo: AdamW, a sync every 2 steps)."""
    options, opt_name = (DEMO, "sgd_plain") if mode == "demo" else ({"sync_every": 2}, "adamw")
    torch.manual_seed(0)
    base = make_model("mlp").to(DEVICE)
    models = {flag: copy.deepcopy(base) for flag in (False, True)}
    config, loss_fn = mode_config(mode, **options), nn.CrossEntropyLoss()
    steps = {
        flag: transpile(m, OPTIMIZERS[opt_name](m.parameters()), config, loss_fn, execution=Execution(compile=flag))
        for flag, m in models.items()
    }
    gen = torch.Generator().manual_seed(1)
    ran: dict[bool, set[str]] = {False: set(), True: set()}
    for _ in range(6):
        batch = tuple(t.to(DEVICE) for t in make_batch("mlp", 16, gen))
        for flag, step in steps.items():
            ran[flag] |= exchange_ops_run(step, batch)
    worst = max((a - b).abs().max().item() for a, b in zip(models[True].parameters(), models[False].parameters()))
    print(f"GPU compiled {mode} vs uncompiled: {worst:.3g}; compile s {steps[True].compile_seconds}")
    assert ran[False] and not ran[True]
    assert worst <= 1e-5


# ------------------------------------------------------------------ cuda_graph=True (captured programs)
CAPTURED_CASES = {  # label: (model, optimizer, mode, options, autocast)
    "fused_sgd": ("mlp", "sgd", "fused_allreduce", {}, None),
    "fused_adamw": ("mlp", "adamw", "fused_allreduce", {}, None),
    "cnn_bn_bf16": ("cnn", "sgd", "fused_allreduce", {}, torch.bfloat16),
    "tied_adamw": ("tied", "adamw", "fused_allreduce", {}, None),
    "none": ("mlp", "adamw", "none", {}, None),
    "local_sgd": ("mlp", "sgd", "local_sgd", {"k_steps": 3}, None),
    "accumulate": ("mlp", "adamw", "fused_allreduce", {"accumulation": Accumulation(steps=2)}, None),
    "clip_loss_scale_fp16": (
        "mlp",
        "sgd",
        "fused_allreduce",
        {"clipping": Clipping(max_norm=1.0), "loss_scaling": LossScaling()},
        torch.float16,
    ),
    "zero1": ("tied", "adamw", "zero1", {}, None),
    "zero2": ("mlp", "sgd", "zero2", {}, None),
    "zero3": ("tied", "adamw", "zero3", {}, None),
}


def _pair(model_name, opt_name, mode, options, **flags):
    """The same model twice, one transpiled plainly and one with ``flags`` (cuda_graph=True, compile=True)."""
    torch.manual_seed(0)
    plain_model = make_model(model_name).to(DEVICE)
    captured_model = copy.deepcopy(plain_model)
    plain_opt, captured_opt = (
        OPTIMIZERS[opt_name](plain_model.parameters()),
        OPTIMIZERS[opt_name](captured_model.parameters()),
    )
    loss_fn = nn.CrossEntropyLoss()
    plain = transpile(
        plain_model,
        plain_opt,
        mode_config(mode, **options),
        loss_fn,
        execution=Execution(compile=flags.get("compile", False)),
    )
    captured = transpile(
        captured_model, captured_opt, mode_config(mode, **options), loss_fn, execution=Execution(**flags)
    )
    return (plain_model, plain_opt, plain), (captured_model, captured_opt, captured)


def _same_steps(plain, captured, model_name, autocast, steps, gen) -> list[float]:
    """Run both ``steps`` times on the same batches; the largest difference per step (losses, parameters,
    optimizer state and buffers)."""
    worst = []
    for _ in range(steps):
        batch = tuple(t.to(DEVICE) for t in make_batch(model_name, 16, gen))
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            a, b = plain[2](*batch), captured[2](*batch)
        diffs = [(a - b).abs().max().item()]
        diffs += [
            (x - y).abs().max().item()
            for x, y in zip(plain[0].state_dict().values(), captured[0].state_dict().values())
        ]
        for s1, s2 in zip(plain[1].state.values(), captured[1].state.values()):
            diffs += [(s1[k].float() - s2[k].float()).abs().max().item() for k in s1]
        assert plain[2].last_metrics == captured[2].last_metrics
        worst.append(max(diffs))
    return worst


@pytest.mark.parametrize("case", list(CAPTURED_CASES))
def test_captured_step_is_bitwise_the_uncaptured_step(case):
    """12 steps: 2 warm-ups, the capture, then replays; every variant captured once; the user's parameters,
    buffers and optimizer state stay where they were from the first replay on."""
    model_name, opt_name, mode, options, autocast = CAPTURED_CASES[case]
    plain, captured = _pair(model_name, opt_name, mode, options, cuda_graph=True)
    gen = torch.Generator().manual_seed(1)
    worst = _same_steps(plain, captured, model_name, autocast, 3, gen)
    addresses = state_addresses(captured[0], captured[1])
    worst += _same_steps(plain, captured, model_name, autocast, 9, gen)
    print(f"GPU captured {case}: largest difference per step {max(worst)}; captures {captured[2].captures}")
    assert max(worst) == 0.0
    assert state_addresses(captured[0], captured[1]) == addresses
    assert set(captured[2].captures.values()) == {1}


def test_captured_program_issues_the_same_collectives():
    """Statically (the captured device part holds the program's collectives in order) and on the GPU (a replay
    runs the kernels of an uncaptured step, copies aside). In a world of one NCCL runs no kernel for an in-place
    all-reduce (it has nothing to send), so the kernels compared are the step's own."""
    from transpiler.graph.collectives import communication_plan

    plain, captured = _pair("mlp", "sgd", "fused_allreduce", {"bucket_cap_mb": 0.01}, cuda_graph=True)
    gen = torch.Generator().manual_seed(1)
    _same_steps(plain, captured, "mlp", None, 4, gen)
    runner = captured[2]._state.built.runners["step"]
    assert communication_plan(runner.device.graph) == communication_plan(plain[2].graph_module.graph)
    batch = tuple(t.to(DEVICE) for t in make_batch("mlp", 16, gen))
    kernels = []
    for step in (plain[2], captured[2]):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(*batch)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        kernels.append(Counter(n for n in names if not n.lower().startswith(("memcpy", "memset"))))
    print(f"GPU kernels per step, uncaptured / captured: {sum(kernels[0].values())} / {sum(kernels[1].values())}")
    assert kernels[0] == kernels[1] and kernels[0], (kernels[0] - kernels[1], kernels[1] - kernels[0])


def test_captured_step_recaptures_on_retrace_and_new_state():
    """A new model mode is a new program, captured after its own warm-up; a loaded optimizer state (new tensors)
    is copied into the flat buffers the capture reads (runtime/flat_storage.py), so it is not captured again.
    Each stays bitwise the uncaptured step."""
    plain, captured = _pair("cnn", "adamw", "fused_allreduce", {}, cuda_graph=True)
    gen = torch.Generator().manual_seed(2)
    worst = _same_steps(plain, captured, "cnn", None, 4, gen)
    for step in (plain, captured):  # the same checkpoint into both: new optimizer-state tensors
        step[1].load_state_dict(copy.deepcopy(plain[1].state_dict()))
    worst += _same_steps(plain, captured, "cnn", None, 2, gen)
    assert captured[2].captures == {"step": 1}
    for step in (plain, captured):
        step[0].eval()
    worst += _same_steps(plain, captured, "cnn", None, 4, gen)
    assert captured[2].captures == {"step": 1}  # the eval program's own runner
    print(f"GPU captured retrace: largest difference {max(worst)}")
    assert max(worst) == 0.0


def test_captured_and_compiled_follows_compiled_within_an_ulp():
    """Captured and compiled against compiled alone, over 8 steps. Inductor compiles the captured step's device part
    (the program less its host part), not the whole program, and may fuse it otherwise: 0.0 on the H200, 1.9e-9
    (an ulp of the weights) on the H100, from the first step on and not growing."""
    torch._dynamo.reset()
    plain, captured = _pair("mlp", "adamw", "fused_allreduce", {}, compile=True, cuda_graph=True)
    worst = _same_steps(plain, captured, "mlp", None, 8, torch.Generator().manual_seed(3))
    print(f"GPU captured+compiled vs compiled: {max(worst)}; compile s {captured[2].compile_seconds}")
    assert max(worst) <= 1e-8


def test_cuda_graph_refuses_what_a_capture_cannot_hold():
    from transpiler.errors import ConfigurationError, UnsupportedOptimizerError

    model = make_model("mlp").to(DEVICE)
    with pytest.raises(UnsupportedOptimizerError, match="generic path"):
        transpile(model, torch.optim.RMSprop(model.parameters()), execution=Execution(cuda_graph=True))
    with pytest.raises(ConfigurationError, match="model's tensors are on"):
        cpu_model = make_model("mlp")
        transpile(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.1), execution=Execution(cuda_graph=True))


def test_diloco_offloaded_global_weights_leave_the_device_between_syncs():
    """``offload_global=True``: θ_global lives in host memory, so between syncs the device holds one copy of
    the weights fewer (measured: what each run adds to the allocator's count), and the run is the on-device run
    bit for bit (the copies are exact)."""
    import gc

    ends, held = {}, {}
    for offload in (False, True):
        gc.collect()
        before = torch.cuda.memory_allocated(DEVICE)
        torch.manual_seed(0)
        model = make_model("mlp").to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = transpile(model, opt, DiLoCo(sync_every=3, offload_global=offload), loss_fn=nn.CrossEntropyLoss())
        gen = torch.Generator().manual_seed(1)
        for _ in range(7):  # two syncs, then one inner step
            step(*(t.to(DEVICE) for t in make_batch("mlp", 16, gen)))
        torch.cuda.synchronize()
        held[offload] = torch.cuda.memory_allocated(DEVICE) - before
        places = {t.device.type for t in step.global_parameters().values()}
        assert places == ({"cpu"} if offload else {"cuda"}), places
        ends[offload] = [t.detach().cpu() for t in [*model.parameters(), *step.global_parameters().values()]]
        del model, opt, step
    weights = sum(p.numel() * p.element_size() for p in make_model("mlp").parameters())
    print(f"GPU diloco offload: device bytes held between syncs {held[False]} -> {held[True]} (weights {weights})")
    assert held[False] - held[True] >= weights
    assert all(torch.equal(a, b) for a, b in zip(ends[False], ends[True]))


def test_quorum_on_nccl_is_bitwise_the_step_without_one():
    """``fault_tolerance`` on a GPU: the collectives across replica groups run on torchft's ``ProcessGroupNCCL``
    (a quorum of this one group), and every step commits and is bitwise the same mode's step without a quorum
    (the participant count 1 is fed as an input, so the mean's factor is ``reciprocal(1)``), for the
    data-parallel mode, ZeRO-2 and ZeRO-3 (a group of one rank: its shard summed across) and DiLoCo and Streaming
    DiLoCo (two syncs)."""
    pytest.importorskip("torchft")
    from tests.quorum_alone import one_group_against_plain

    modes = ("fused_allreduce", "zero2", "zero3", "diloco", "streaming_diloco")
    worst = one_group_against_plain(DEVICE, modes)
    print(f"GPU quorum on NCCL, largest difference to the step without one over 8 steps: {worst}")
    assert worst == dict.fromkeys(modes, 0.0)


def test_a_batch_left_on_the_cpu_for_a_model_on_the_gpu_is_one_clear_batch_error(capfd):
    """The newcomer's batch on the wrong device (issue 62): one BatchMismatchError naming the input, its device and
    the first layer's, with nothing printed before it; the same batch on the GPU then trains."""
    from transpiler import BatchMismatchError

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(DEVICE)
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "fused_allreduce", nn.CrossEntropyLoss())
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    capfd.readouterr()
    with pytest.raises(BatchMismatchError) as info:
        step(x, y)
    printed = capfd.readouterr()
    message = str(info.value)
    print(f"GPU batch on the CPU: {message}")
    assert printed.err == "" and printed.out == "", printed.err[-2000:]
    assert "input 0 of the batch (shape (4, 8), float32, on cpu)" in message and "on cuda:0" in message
    assert torch.isfinite(step(x.to(DEVICE), y.to(DEVICE)))
