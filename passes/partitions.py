"""Consecutive parts of the trainable parameters, as gradient freeze (``freeze-groups``) and partial
averaging (``partial-average``) cut them, and the check of a part's options against the model."""

from __future__ import annotations

from transpiler.errors import ConfigurationError


def check_part(option: str, parts: int, index_name: str, index: int, trainable: int) -> None:
    """``parts`` (the user's option ``option``) parts over ``trainable`` parameters, ``index`` one of them."""
    if parts > trainable:
        raise ConfigurationError(
            f"{option}={parts}, but the model has {trainable} trainable parameters; use at most {trainable}."
        )
    if index >= parts:
        raise ConfigurationError(f"{index_name} {index} is not below {option}={parts}.")


def group_bounds(count: int, groups: int) -> list[int]:
    """Start of each of ``groups`` consecutive groups over ``count`` items, then ``count``."""
    return [round(j * count / groups) for j in range(groups + 1)]


def partition_of(sizes: list[int], partitions: int) -> list[int]:
    """The partition of each item: consecutive, balanced by size, none empty when there are enough items.

    An item's balanced partition is where its middle falls in the cumulative size; it is then held
    within one step of the previous item's and early enough that every later partition still gets one.
    """
    total, n = sum(sizes) or 1, len(sizes)
    out: list[int] = []
    start = 0
    for i, size in enumerate(sizes):
        balanced = int(partitions * (start + size / 2) / total)
        previous = out[-1] if out else 0
        low = max(previous, partitions - (n - i)) if out else 0
        high = min(previous + 1, partitions - 1) if out else 0
        out.append(min(max(balanced, low), high))
        start += size
    return out
