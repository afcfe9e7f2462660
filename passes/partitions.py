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


def module_fragments(params: list[tuple[str, int]], fragments: int) -> dict[str, int]:
    """Each parameter's fragment (Streaming DiLoCo): whole modules (the parameters whose names share all but the
    last part), consecutive in model order and balanced by size (:func:`partition_of`); a ``ConfigurationError``
    when there are fewer modules than fragments."""
    modules = module_sizes(params)
    if fragments > len(modules):
        raise ConfigurationError(
            f"fragments={fragments}, but the model's trainable parameters sit in {len(modules)} modules, and a "
            f"fragment holds whole modules; use at most {len(modules)}."
        )
    part = dict(zip(modules, partition_of(list(modules.values()), fragments)))
    return {name: part[name.rpartition(".")[0]] for name, _ in params}


def module_sizes(params: list[tuple[str, int]]) -> dict[str, int]:
    """The modules that hold the parameters (the names' all but last part), in model order, with their sizes."""
    modules: dict[str, int] = {}
    for name, size in params:
        owner = name.rpartition(".")[0]
        modules[owner] = modules.get(owner, 0) + size
    return modules
