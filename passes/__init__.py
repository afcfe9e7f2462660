"""The rewrite passes, one per module, with their shared helpers. ``PASSES`` names them (``registry.py``) and
loads a pass's module when it is first looked up: ``PASSES["fuse-allreduce"]`` is the class of that pass.

A pass builds on ``transpiler.graph`` (and ``transpiler.errors``) only (docs/design.md#layers).
"""

from .registry import PASSES

__all__ = ["PASSES"]
