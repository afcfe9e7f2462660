"""The rewrite passes, one per module, with their shared helpers. ``PASSES`` (``registry.py``) names them:
``PASSES["fuse-allreduce"]`` is that pass's class, its module loaded when it is first looked up. A pass is also
here by its class's name (``from passes import FuseAllReduce``), looked up in the registry the same way.

A pass builds on ``transpiler.graph`` (and ``transpiler.errors``) only (docs/design.md#layers). Importing this
package loads no pass, and the ``transpiler`` package loads none while it loads: so either may be imported
first, and neither waits on the other half-loaded.
"""

from .registry import PASSES, WHERE

_CLASSES = {where.partition(":")[2]: name for name, where in WHERE.items()}  # class name -> pass name

__all__ = ["PASSES", *_CLASSES]


def __getattr__(attribute: str) -> type:
    """A pass class by its own name, from the registry (which loads its module)."""
    if attribute in _CLASSES:
        return PASSES[_CLASSES[attribute]]
    raise AttributeError(f"module 'passes' has no attribute '{attribute}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CLASSES})
