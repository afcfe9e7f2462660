"""Split points of a pipeline, marked while the step is traced: the input of each module named as a split point
goes through ``transpiler::stage_input`` (and its gradient through ``stage_input_grad``), so the traced step says
where every stage starts, forward and backward alike (``graph/stage_ops.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.stage_ops import stage_input


@contextlib.contextmanager
def marked_stages(model: torch.nn.Module, split_points: Sequence[str]) -> Iterator[None]:
    """Inside, stage ``k`` (1, 2, ...) starts at the input of the module ``split_points[k - 1]``, which takes a
    tensor first. An error names a split point that is not a module of the model; ``split-stages`` checks that each
    ran once per forward, in the traced graph."""
    modules = dict(model.named_modules())
    unknown = [name for name in split_points if name not in modules]
    if unknown:
        listed = ", ".join(n for n, m in model.named_children())
        raise ConfigurationError(
            f"split point(s) {unknown} are not modules of the model; name modules as model.named_modules() does "
            f"(its children: {listed})."
        )

    def hook_for(name: str, stage: int):
        def mark(module: torch.nn.Module, args: tuple) -> tuple:
            if not args or not isinstance(args[0], torch.Tensor):
                raise ConfigurationError(
                    f"split point '{name}' takes {type(args[0]).__name__ if args else 'no positional argument'} "
                    "first; a stage starts from one tensor, the first positional argument of its first module."
                )
            return (stage_input(args[0], stage), *args[1:])

        return mark

    handles = [modules[name].register_forward_pre_hook(hook_for(name, k + 1)) for k, name in enumerate(split_points)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
