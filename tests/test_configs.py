"""One typed config per mode (issue 73): checked when made, data (printed, compared, a dict, JSON), the same
names as the passes that read them, and the keywords of before still building the same programs.

Static (no world runs): about 20 s on a 2-core machine, most of it building every mode's programs twice, through a
config and through the old keywords (one trace, shared by a ``TraceCache``)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import warnings

import pytest
import torch
from torch import nn

import passes
import transpiler
from passes.registry import WHERE
from transpiler import (
    Accumulation,
    AdaSum,
    Clipping,
    Compression,
    ConfigurationError,
    DataParallel,
    DeMo,
    DiLoCo,
    Execution,
    Freeze,
    LossScaling,
    PassPipeline,
    PipelineSpecError,
    RenamedWarning,
    SparseLoCo,
    Sparsification,
    StaticWorld,
    StreamingDiLoCo,
    TraceCache,
    ZeRO,
    config_from_dict,
    load_config,
    mode_config,
    transpile,
)
from transpiler.graph.config import field_spec
from transpiler.graph.options import field_options
from transpiler.graph.pipeline import format_value, parse_spec
from transpiler.graph.renames import RENAMED, current_spec
from transpiler.strategies.modes import MODES

pytestmark = pytest.mark.quick


def defaults_of(name: str):
    cls, _ = MODES[name]
    return cls.from_dict({"mode": name})


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_is_a_config_that_prints_compares_and_round_trips(name):
    """A mode's name is its config with the defaults; the config prints as the expression that makes it, and
    goes through a dict and JSON back to an equal config."""
    config = defaults_of(name)
    assert config.mode == name and mode_config(name) == config
    assert eval(repr(config), vars(transpiler)) == config  # noqa: S307 - the repr is the expression
    assert config_from_dict(config.to_dict()) == config
    assert config_from_dict(json.loads(config.to_json())) == config
    assert json.loads(config.to_json())["mode"] == name


def test_a_config_with_features_round_trips_and_prints_what_differs():
    config = ZeRO(
        stage=3,
        bucket_cap_mb="layer",
        accumulation=Accumulation(steps=4),
        loss_scaling=LossScaling(growth_interval=100),
        clipping=Clipping(max_norm=1.0, norm_type=math.inf),
    )
    assert repr(config) == (
        "ZeRO(stage=3, bucket_cap_mb='layer', accumulation=Accumulation(steps=4), "
        "loss_scaling=LossScaling(growth_interval=100), clipping=Clipping(max_norm=1.0, norm_type=inf))"
    )
    data = json.loads(config.to_json())
    assert data["clipping"] == {"max_norm": 1.0, "norm_type": "inf"}  # a named value by its name: JSON has no inf
    assert config_from_dict(data) == config and hash(config) == hash(config_from_dict(data))
    assert config != dataclasses.replace(config, prefetch=2)


def test_a_config_file_is_read_and_its_errors_name_the_file(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(DiLoCo(sync_every=7, clipping=Clipping(max_norm=2.0)).to_json())
    assert load_config(path) == DiLoCo(sync_every=7, clipping=Clipping(max_norm=2.0))
    (tmp_path / "bad.json").write_text("{mode: zero3")
    with pytest.raises(ConfigurationError, match="bad.json is not JSON"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(ConfigurationError, match="cannot read the config file"):
        load_config(tmp_path / "none.json")
    with pytest.raises(ConfigurationError, match="a config names its mode"):
        config_from_dict({"stage": 3})
    with pytest.raises(ConfigurationError, match="mode 'zero3' is ZeRO with stage=3; the data also says stage=2"):
        config_from_dict({"mode": "zero3", "stage": 2})
    assert config_from_dict({"pipeline": "scale-loss-grad,allreduce-grads"}) == PassPipeline(
        spec="scale-loss-grad,allreduce-grads"
    )


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: ZeRO(stage=4), "option 'stage' of ZeRO wants an int >= 1 and <= 3; got 4 \\(too large\\)"),
        (lambda: DataParallel(bucket_cap_mb=-1), "'bucket_cap_mb' of DataParallel wants a finite float >= 0 or 'auto'"),
        (lambda: DataParallel(first_bucket_mb=float("nan")), "not finite"),
        (lambda: DiLoCo(sync_every=2.5), "'sync_every' of DiLoCo wants an int >= 1; got 2.5"),
        (lambda: StreamingDiLoCo(exchange_dtype="float64"), "'exchange_dtype' of StreamingDiLoCo wants one of"),
        (lambda: DeMo(topk=0), "'topk' of DeMo wants an int >= 1"),
        (lambda: DeMo(quantization_bins=1), "quantization_bins=1: DeMo quantises to 2 to 256 bins"),
        (lambda: SparseLoCo(chunk_size=4, topk=20), "topk=20 of a 4×4 tile"),
        (lambda: Clipping(max_norm=0.0), "would zero every gradient"),
        (lambda: Accumulation(steps=1), "accumulates nothing"),
        (lambda: Freeze(groups=1), "freezes nothing"),
        (lambda: Compression(wire_dtype="none"), "'wire_dtype' of Compression wants one of fp16, bf16"),
        (lambda: config_from_dict({"mode": "zero1", "clipping": {}}), "missing 1 required .* argument: 'max_norm'"),
        (lambda: DataParallel(fused=False, bucket_cap_mb=4), "mode 'allreduce' .* takes no bucket_cap_mb"),
        (lambda: ZeRO(stage=2, prefetch=2), "mode 'zero2' .* takes no prefetch"),
        (lambda: ZeRO(stage=1, bucket_cap_mb="cost"), "sizes ZeRO-3's gather units"),
        (lambda: AdaSum(target="deltas", loss_scaling=LossScaling()), "mode 'adasum_delta' .* takes no loss_scaling"),
        (lambda: DataParallel(accumulation=4), "field 'accumulation' of DataParallel wants a Accumulation or None"),
        (lambda: DataParallel(sparsification=Sparsification(ratio=0.1), compression=Compression()), "pick one"),
        (lambda: DataParallel(sparsification=Sparsification(ratio=0.1), loss_scaling=LossScaling()), "residuals"),
        (lambda: StreamingDiLoCo(sync_every=4, fragments=8), "fragments"),
        (lambda: PassPipeline(spec="scale-loss-grad,no-such-pass"), "unknown pass 'no-such-pass'"),
        (lambda: Execution(timeout=-1), "timeout must be positive"),
        (lambda: Execution(trajectory_every=5), "trajectory_every only applies with save_trajectory"),
        (lambda: StaticWorld(size=2, rank=2), "rank 2 is outside the world of size 2"),
        (lambda: mode_config("zero3", freeze=Freeze(groups=2)), "'freeze' works with allreduce, fused_allreduce"),
        (lambda: mode_config("zero4"), "unknown mode 'zero4'. Modes: none, allreduce"),
        (lambda: mode_config("scale-loss-grad,allreduce-grads"), "an explicit pipeline of passes is PassPipeline"),
    ],
)
def test_a_bad_value_is_refused_when_the_config_is_made_naming_the_field(make, words):
    with pytest.raises(ConfigurationError, match=words):
        make()


def test_every_knob_is_the_option_of_that_name_of_a_pass_and_reaches_it():
    """Each field of a mode's config that is a pass's option has the pass's name for it, its type and bounds,
    and the pipeline the config builds hands it to that pass: a value other than the default shows in the spec."""
    checked = 0
    for name, (cls, entry) in MODES.items():
        for f in dataclasses.fields(cls):
            pass_name = f.metadata.get("pass")
            if pass_name is None or f.name in entry.implied or f.name in entry.without:
                continue
            assert f.name in field_options(passes.PASSES[pass_name]), f"{cls.__name__}.{f.name} is no {pass_name}"
            config = defaults_of(name)
            value = _another(field_spec(cls, f.name), getattr(config, f.name))
            if name == "dim_reduce" and f.name == "pca_path":
                value = "basis.pt"
            changed = dataclasses.replace(config, **{f.name: value})
            specs = ",".join(changed.strategy().specs().values())
            written = f"{f.name.replace('_', '-')}={format_value(getattr(changed, f.name))}"
            assert re.search(rf"{pass_name}\{{[^}}]*{re.escape(written)}[,}}]", specs), (name, written, specs)
            checked += 1
    assert checked > 40


def _another(spec, value):
    """A valid value of an option other than ``value``."""
    if spec.kind is bool:
        return not value
    if spec.choices:
        return next(c for c in spec.choices if c != value)
    if isinstance(value, str):  # a named value (bucket_cap_mb='cost'): a number instead
        return 3.0
    if spec.kind is int:
        return (value + 1 if value else 2) if spec.maximum is None or value < spec.maximum else value - 1
    return (value + spec.maximum) / 2 if spec.maximum is not None and value < spec.maximum else value / 2 + 0.25


def test_old_option_names_still_work_with_a_warning_that_names_the_new_ones():
    with pytest.warns(RenamedWarning, match="'accumulate_steps' is now accumulation.steps.*'max_grad_norm' is now"):
        config = mode_config("fused_allreduce", accumulate_steps=4, max_grad_norm="1.5", norm_type="inf")
    assert config == DataParallel(
        accumulation=Accumulation(steps=4), clipping=Clipping(max_norm=1.5, norm_type=math.inf)
    )
    with pytest.warns(RenamedWarning):
        assert mode_config("zero2", loss_scale="dynamic", growth_interval=10) == ZeRO(
            stage=2, loss_scaling=LossScaling(growth_interval=10)
        )
        assert mode_config("zero1", loss_scale=128) == ZeRO(
            stage=1, loss_scaling=LossScaling(dynamic=False, init_scale=128)
        )
        assert mode_config("fused_allreduce", accumulate_steps=1, loss_scale="off", compress="none") == DataParallel()
        assert mode_config("fused_allreduce", compress="bf16", sparsify=0) == DataParallel(
            compression=Compression(wire_dtype="bf16")
        )
        assert mode_config("demo", compression_topk=4, compression_chunk=16) == DeMo(topk=4, chunk_size=16)
        assert mode_config("adaptive_local_sgd", init_k_steps=3).k_steps == 3
        with pytest.raises(ConfigurationError, match="option 'growth_interval' .* only applies with 'loss_scale'"):
            mode_config("zero2", growth_interval=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current names warn about nothing
        assert mode_config("fused_allreduce", **{"accumulation.steps": "4"}) == DataParallel(
            accumulation=Accumulation(steps=4)
        )


def test_renamed_pass_options_still_read_in_a_spec_and_in_a_checkpoint():
    with pytest.warns(RenamedWarning, match="option 'chunk' of pass 'demo-exchange' is now 'chunk_size'"):
        (exchange,) = parse_spec("demo-exchange{chunk=16}", passes.PASSES)
    assert exchange.chunk_size == 16
    old = "broadcast-params,fuse-allreduce{compress=fp16},diloco-outer-step{exchange=bfloat16,alpha=0.5,error-lr=2.0}"
    assert current_spec(old) == (
        "broadcast-params,fuse-allreduce{wire-dtype=fp16},"
        "diloco-outer-step{exchange-dtype=bfloat16,fragment-update-alpha=0.5,outer-lr=2.0}"
    )
    for pass_name, renames in RENAMED.items():
        names = field_options(passes.PASSES[pass_name])
        assert set(renames.values()) <= set(names) and not set(renames) & set(names), pass_name
    with pytest.raises(PipelineSpecError, match="takes no option"):
        parse_spec("fuse-allreduce{wire=fp16}", passes.PASSES)


def test_a_snapshot_written_with_old_option_names_loads():
    model = nn.Linear(3, 2)
    config = DataParallel(compression=Compression())
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), config, nn.MSELoss())
    step(torch.randn(4, 3), torch.randn(4, 2))
    snapshot = step.state_dict()
    setup = snapshot["transpiler"]["setup"]
    setup["mode"] = {v: spec.replace("wire-dtype=", "compress=") for v, spec in setup["mode"].items()}
    assert "compress=fp16" in setup["mode"]["step"]
    with pytest.warns(RenamedWarning, match="names pass options by names they had before"):
        step.load_state_dict(snapshot)


def test_the_old_keywords_build_the_same_programs_as_the_configs():
    """``transpile(..., mode, **options)`` and the flat execution keywords still work, with one warning that
    writes the call anew, and build exactly the programs of the config they stand for."""
    cache = TraceCache()
    cases = [
        (
            "fused_allreduce",
            {"bucket_cap_mb": 0.001, "accumulate_steps": 2},
            DataParallel(bucket_cap_mb=0.001, accumulation=Accumulation(steps=2)),
        ),
        (
            "zero3",
            {"loss_scale": "dynamic", "max_grad_norm": 1.0},
            ZeRO(stage=3, loss_scaling=LossScaling(), clipping=Clipping(max_norm=1.0)),
        ),
        (
            "streaming_diloco",
            {"sync_every": 2, "fragments": 2, "fragment_update_alpha": 0.5},
            StreamingDiLoCo(sync_every=2, fragments=2, fragment_update_alpha=0.5),
        ),
        ("demo", {"compression_topk": 2, "compression_chunk": 4}, DeMo(topk=2, chunk_size=4)),
    ]
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    for mode, options, config in cases:
        builds = []
        for how in ("old", "new"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = nn.CrossEntropyLoss()
            if how == "old":
                with pytest.warns(RenamedWarning, match=r"keywords \[.*\] are deprecated: write transpile\(model"):
                    step = transpile(model, optimizer, mode=mode, loss_fn=loss, example_inputs=batch, world_size=2,
                                     rank=1, verify=True, trace=cache, **options)  # fmt: skip
            else:
                step = transpile(model, optimizer, config, loss, batch, mesh=StaticWorld(size=2, rank=1), trace=cache)
            builds.append({v: p.graph_module.code for v, p in step.programs.items()})
        assert builds[0] == builds[1], mode
    with pytest.warns(RenamedWarning, match="a pipeline spec as the mode is deprecated: write PassPipeline"):
        model = nn.Linear(3, 2)
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "scale-loss-grad,allreduce-grads", nn.MSELoss())


def test_transpile_takes_eleven_parameters_and_no_option_by_name():
    """Ten since issue 73, and the pipeline's dimension (issue 75): each a typed object, never an option by name."""
    signature = inspect.signature(transpile)
    named = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 11
    assert [p.name for p in named] == [
        "model", "optimizer", "config", "loss_fn", "example_inputs", "mesh", "fault_tolerance", "execution",
        "trace", "outer_optimizer", "pipeline",
    ]  # fmt: skip


def test_the_passes_package_names_each_registered_pass_for_readers():
    """``passes.FuseAllReduce`` leads a reader (an IDE's go-to-definition) from a config's recipe to the pass: the
    package's TYPE_CHECKING imports name every pass of the registry, and only those."""
    source = inspect.getsource(passes)
    imported = set(re.findall(r"from \.(\w+) import (\w+) as \2", source))
    assert imported == {tuple(where.split(":")) for where in WHERE.values()}
