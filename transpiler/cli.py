"""The ``transpiler`` command: dump and diff rewritten graphs, list passes and modes."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import warnings
from pathlib import Path

import torch

from passes.registry import PASSES
from transpiler.graph.basis import compute_basis
from transpiler.graph.options import key_values
from transpiler.graph.pipeline import format_value
from transpiler.graph.ports import IN_FLIGHT
from transpiler.graph.program import StepProgram
from transpiler.graph.render import to_dot, to_json, to_svg, unified_diff
from transpiler.runtime.execution import Execution
from transpiler.runtime.fault_tolerance import FaultTolerance
from transpiler.runtime.process_group import StaticWorld
from transpiler.strategies.data_parallel import NoSync
from transpiler.strategies.mode_config import ModeConfig
from transpiler.strategies.modes import PassPipeline, as_config, load_config, mode_config
from transpiler.strategies.modes_table import listing, markdown_table
from transpiler.strategies.pipeline_parallel import PipelineParallel

from .api import transpile
from .errors import ConfigurationError, FactoryError, RenamedWarning, TranspilerError
from .factory_file import load_callable, load_factory
from .planner.command import add_commands as add_planner_commands


def _render(program: StepProgram, fmt: str, *, diff: bool) -> str:
    if diff:
        return unified_diff(
            program.history[0][1], program.graph_module.code, after_label=f"after {program.history[-1][0]}"
        )
    graph = program.graph
    title = f"rank {program.rank} of {program.world_size}"
    if fmt == "code":
        return program.graph_module.code.lstrip("\n")
    if fmt == "dot":
        return to_dot(graph, title).to_string()
    if fmt == "svg":
        return to_svg(graph, title)
    return to_json(program, graph)


def _op_counts_table(program: StepProgram) -> str:
    """The ops the program dispatches per step after tracing and after each pass, and what each pass changed."""
    lines = ["stage                           work  views  copies   (change)"]
    previous = None
    for label, counts in program.op_counts:
        change = ""
        if previous is not None:
            deltas = (counts.work - previous.work, counts.views - previous.views, counts.copies - previous.copies)
            change = "(" + ", ".join(f"{d:+d}" for d in deltas) + ")" if any(deltas) else "(no change)"
        lines.append(
            f"{label.split('{')[0]:28s} {counts.work:7d} {counts.views:6d} {counts.copies:7d}   {change}".rstrip()
        )
        previous = counts
    return "\n".join(lines)


def _schedule_table(step, calls: int, mode: str) -> str:
    """The program each of the first ``calls`` calls of ``step`` runs (a fresh copy of its schedule), what that
    program sends, and which exchanges it leaves in flight for a later call or finishes from an earlier one."""
    schedule = copy.deepcopy(step.schedule)
    lines = [
        "| call | program | collectives (bytes per message) | leaves in flight | finishes |",
        "|---:|---|---|---|---|",
    ]
    for call in range(1, calls + 1):
        variant = schedule.variant()
        try:
            schedule.observe(variant, {}, 0.0)
        except KeyError as missing:  # adaptive_local_sgd picks its next k from the loss it measures
            raise FactoryError(
                f"the schedule of mode '{mode}' follows a metric measured while training ({missing}), "
                "so no table of calls holds before the run; --schedule prints schedules fixed by the step count."
            ) from None
        program = step.programs[variant]
        sent = [
            f"{n.target._schema.name.split('::')[-1]} {n.meta['collective'].get('bytes', 0):,}"
            for n in program.graph.nodes
            if "collective" in n.meta
        ]
        starts = [p.name for p in program.outputs if p.kind == "extra" and p.name.startswith(IN_FLIGHT)]
        ends = [p.name for p in program.inputs if p.kind == "extra" and p.name.startswith(IN_FLIGHT)]
        lines.append(
            f"| {call} | {variant} | {', '.join(sent) or '–'} | {', '.join(starts) or '–'} | {', '.join(ends) or '–'} |"
        )
    return "\n".join(lines) + "\n"


def config_of(args: argparse.Namespace) -> ModeConfig:
    """The config ``dump`` builds: ``--config FILE`` or ``--pipeline SPEC`` or ``--mode NAME``, with ``-O`` on
    top (a config's fields by name; a feature's dotted, ``-O accumulation.steps=4``)."""
    options = key_values(args.option)
    if args.before:
        return NoSync()
    if args.config is not None:
        return load_config(args.config, **options)
    if args.pipeline is not None:
        if options:
            raise ConfigurationError("-O sets a mode's options; put a pipeline's pass options in its spec.")
        return PassPipeline(spec=args.pipeline)
    if options:
        return mode_config(args.mode, **options)
    return as_config(args.mode)  # a spec given to --mode: deprecated, with its warning


def add_pipeline_arguments(dump: argparse.ArgumentParser) -> None:
    """``dump``'s pipeline: ``--stages`` and its settings."""
    dump.add_argument(
        "--stages",
        type=int,
        help="cut the model into this many pipeline stages (the world: one rank per stage; --rank picks the stage)",
    )
    dump.add_argument("--microbatches", type=int, default=4, help="with --stages: microbatches per batch")
    dump.add_argument(
        "--pp-schedule",
        default="1f1b",
        help="with --stages: the pipeline's schedule (gpipe, 1f1b, zbh1, interleaved_1f1b)",
    )
    dump.add_argument(
        "--virtual-stages", type=int, default=1, help="with --stages: chunks per rank (interleaved_1f1b: 2 or more)"
    )
    dump.add_argument(
        "--split-points", help="with --stages: module names, comma-separated (default: balanced by estimated time)"
    )


def pipeline_of(args: argparse.Namespace) -> PipelineParallel | None:
    """``--stages`` and its settings as a pipeline (None without it)."""
    if args.stages is None:
        return None
    split = args.split_points or ()
    return PipelineParallel(
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=args.pp_schedule,
        split_points=split,
        virtual_stages=args.virtual_stages,
    )


def cmd_dump(args: argparse.Namespace) -> int:
    if args.diff and args.format != "code":
        raise FactoryError(f"--diff prints a unified diff of the code; it cannot be drawn as {args.format}.")
    if sum(x is not None for x in (args.config, args.pipeline)) + hasattr(args, "mode") > 1:
        raise FactoryError("give one of --mode, --config and --pipeline.")
    args.mode = getattr(args, "mode", "fused_allreduce")
    config = config_of(args)
    model, optimizer, loss_fn, batch = load_factory(args.factory)

    def show(label: str, program: StepProgram) -> None:
        print(f"# ---- after {label} ----\n{program.graph_module.code}", file=sys.stderr)

    # the program a replica group of --world-size ranks runs under a quorum: no torchft needed to look at it
    quorum = FaultTolerance() if args.fault_tolerance and not args.before else None
    step = transpile(
        model,
        optimizer,
        config,
        loss_fn,
        tuple(batch),
        mesh=StaticWorld(size=args.stages or args.world_size, rank=args.rank),
        fault_tolerance=quorum,
        pipeline=pipeline_of(args),
        execution=Execution(
            verify=not args.no_verify,
            on_pass=show if args.print_between_passes else None,
            memory_budget=args.memory_budget,
        ),
    )
    variants = step.programs
    variant = args.variant or (next(reversed(variants)) if "step" not in variants else "step")
    if variant not in variants:
        raise FactoryError(f"mode '{config.mode}' has variants {', '.join(variants)}; --variant {variant} is not one.")
    if len(variants) > 1:
        print(f"# variant '{variant}' of {', '.join(variants)} (choose with --variant)", file=sys.stderr)
    for name, choice in variants[variant].decisions.items():  # what a pass chose for this model
        print(f"# {name}: {choice}", file=sys.stderr)
    if args.schedule:
        text = _schedule_table(step, args.schedule, config.mode)
    elif args.op_counts:
        text = _op_counts_table(variants[variant])
    elif args.memory:
        text = str(step.memory_estimate(variant))
    else:
        text = _render(variants[variant], args.format, diff=args.diff)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({len(text)} characters)", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_passes(args: argparse.Namespace) -> int:
    width = max(map(len, PASSES))
    for name, cls in PASSES.items():
        opts = ", ".join(f"{f.name.replace('_', '-')}={format_value(f.default)}" for f in dataclasses.fields(cls))
        print(f"{name:{width}s}  {cls.summary}" + (f"  [{opts}]" if opts else ""))
    return 0


def cmd_modes(args: argparse.Namespace) -> int:
    sys.stdout.write(markdown_table() if args.markdown else listing())
    return 0


def cmd_pca(args: argparse.Namespace) -> int:
    basis = compute_basis(Path(args.trajectory), args.components)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    torch.save(basis, args.output)  # before the report, so a closed pipe (| head) cannot lose it
    ratios = basis["explained_variance_ratio"]
    print(
        f"{len(basis['steps'])} snapshots (steps {basis['steps'][0]}..{basis['steps'][-1]}), "
        f"{basis['pca_mat'].shape[1]} weights, {len(ratios)} components"
    )
    cumulative = 0.0
    for i, ratio in enumerate(ratios.tolist()):
        cumulative += ratio
        print(f"  component {i + 1:3d}: explained variance {ratio:.4f} (cumulative {cumulative:.4f})")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transpiler",
        description="Dump and diff the rewritten training-step graphs, list passes and modes. "
        "No processes are launched: 'dump' builds one rank's program for a world size statically.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_dump(sub)
    pca = sub.add_parser(
        "pca",
        help="principal directions of a saved weight trajectory (DimReduce's basis)",
        description="Centre the snapshots that Execution(save_trajectory=DIR) wrote and save the top "
        "principal directions, with the parameter layout they were built for.",
    )
    pca.add_argument("trajectory", metavar="TRAJECTORY_DIR")
    pca.add_argument("--components", "-k", type=int, required=True, help="number of principal directions")
    pca.add_argument("-o", "--output", default="pca.pt", help="where to write the basis")
    pca.set_defaults(func=cmd_pca)
    sub.add_parser("passes", help="list the passes").set_defaults(func=cmd_passes)
    modes = sub.add_parser("modes", help="list the modes: their configs, options and pipelines")
    modes.add_argument("--markdown", action="store_true", help="as the README's table")
    modes.set_defaults(func=cmd_modes)
    add_planner_commands(sub, load_factory, load_callable)
    return parser


def add_dump(sub: argparse._SubParsersAction) -> None:
    """The ``dump`` command and its options."""
    dump = sub.add_parser(
        "dump",
        help="build one rank's program and print it",
        description="Build one rank's program from FACTORY, a function in a .py file that returns "
        "(model, optimizer, loss_fn, example_batch), and print it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    dump.add_argument("factory", metavar="FILE.py:FACTORY", help="returns (model, optimizer, loss_fn, example_batch)")
    which_config = dump.add_argument_group("the mode (one of these)")
    which_config.add_argument(
        "--mode",
        default=argparse.SUPPRESS,
        help="a mode's name ('transpiler modes'), with its defaults and -O (default: fused_allreduce)",
    )
    which_config.add_argument("--config", metavar="FILE.json", help="a config as JSON (config.to_json()), -O on top")
    which_config.add_argument("--pipeline", metavar="SPEC", help="passes of your choosing ('transpiler passes')")
    dump.add_argument("--world-size", type=int, default=2, help="number of ranks to build the program for")
    dump.add_argument("--rank", type=int, default=0, help="which rank's program to show")
    add_pipeline_arguments(dump)
    dump.add_argument(
        "--format",
        choices=("code", "dot", "svg", "json"),
        default="code",
        help="code: Python; dot: Graphviz source; svg: a picture (needs Graphviz's 'dot' on PATH); json: nodes",
    )
    which = dump.add_mutually_exclusive_group()
    which.add_argument("--before", action="store_true", help="show the traced graph, before any pass")
    which.add_argument("--diff", action="store_true", help="unified diff of the traced and rewritten code")
    dump.add_argument(
        "--variant",
        help="for modes with several programs (local_sgd: local, sync; diloco: inner, sync; streaming_diloco: inner, "
        "sync<p>, apply<p>)",
    )
    dump.add_argument(
        "--schedule",
        type=int,
        metavar="N",
        help="instead of a graph, the program each of the first N calls runs, what it sends and leaves in flight",
    )
    dump.add_argument("--print-between-passes", action="store_true", help="print the code after every pass (stderr)")
    dump.add_argument(
        "--op-counts",
        action="store_true",
        help="instead of the graph: the ops it dispatches per step (work, views, copies) after tracing and each pass",
    )
    dump.add_argument(
        "--memory",
        action="store_true",
        help="instead of the graph: the step's peak bytes by its schedule, by kind (step.memory_estimate())",
    )
    dump.add_argument(
        "--memory-budget",
        type=float,
        metavar="FRACTION",
        help="recompute forward values until the step's own tensors peak at this fraction of those without (0: least)",
    )
    dump.add_argument(
        "-O",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the mode's config (-O bucket_cap_mb=4), a feature's dotted (-O accumulation.steps=4)",
    )
    dump.add_argument(
        "--fault-tolerance",
        action="store_true",
        help="the program a replica group of --world-size ranks runs under transpile(fault_tolerance=...): the "
        "participant count as an input, the sums across groups on torchft's group (labelled 'quorum')",
    )
    dump.add_argument("--no-verify", action="store_true", help="skip the verifiers between passes")
    dump.add_argument("-o", "--output", help="write here instead of stdout")
    dump.set_defaults(func=cmd_dump)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RenamedWarning)
            try:
                return args.func(args)
            finally:  # an old -O name or --mode with a spec: say the new spelling on stderr
                for warning in caught:
                    if issubclass(warning.category, RenamedWarning):
                        print(f"transpiler: deprecated: {warning.message}", file=sys.stderr)
                    else:
                        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    except TranspilerError as exc:
        print(f"transpiler: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
