"""Pipeline schedules as orders: what each rank runs, microbatch by microbatch, in one step.

The model is cut into chunks (stages of the model), ``virtual`` per rank: chunk ``c`` runs on rank ``c % ranks``
(one chunk per rank but under ``interleaved_1f1b``). An order is a list of actions ``("F", i, c)`` (the forward
of microbatch ``i`` through chunk ``c``) and ``("B", i, c)`` (its backward); a zero-bubble order splits the
backward into ``("B", i, c)``, the gradient of the chunk's input (which the chunk before waits for), and
``("W", i, c)``, the gradients of its weights (which nobody waits for). A rank's program runs its actions in that
order; a forward receives its input from the chunk before, a backward its output's gradient from the chunk after,
and sends never wait. The schedules change the order of work, never the arithmetic: each chunk's weight gradients
are made in microbatch order, so they add up in the same order under all of them.

- ``gpipe``: every forward, then every backward (torch's ``ScheduleGPipe``).
- ``1f1b``: stage ``s`` of ``p`` runs ``min(m, p - s)`` forwards, then one backward and one forward in turn, then
  the backwards left (torch's ``Schedule1F1B``; it holds at most ``p - s`` microbatches' activations, GPipe ``m``).
- ``zbh1``: zero bubble (Qi et al., ICLR 2024, ZB-H1, the order of torch's ``ScheduleInterleavedZeroBubble`` at
  one chunk per rank): stage ``s`` of ``p`` runs ``p - s - 1`` forwards, then a forward and an input gradient in
  turn, each followed by the weight gradient of the microbatch ``s`` back, then the weight gradients left. With
  forward, input and weight gradients alike, a stage idles ``p - 1`` units of ``3m + p - 1`` (1F1B: ``3(p - 1)``
  of ``3(m + p - 1)``); where the first stage's input gradient is empty (its input is the batch) and its weight
  gradient takes two units, the order keeps that length. A stage holds at most ``p`` microbatches whose weight
  gradient is not made yet (1F1B's first stage: ``p``).
- ``interleaved_1f1b``: ``v`` chunks per rank (Narayanan et al., SC 2021; torch's ``ScheduleInterleaved1F1B``):
  the microbatches go in groups of ``p``, each group through the rank's chunks in turn (backwards through them in
  reverse); rank ``r`` runs ``2(p - r - 1) + (v - 1)p`` forwards first, then one forward and one backward in turn.
  Its bubble is ``1/v`` of 1F1B's, for ``p - r`` more microbatches' activations held. It needs ``m`` a multiple of
  ``p``.

:func:`check_orders` runs the stages' orders against each other and raises where one would wait forever.
"""

from __future__ import annotations

from collections.abc import Callable

from transpiler.errors import ConfigurationError

Step = tuple[str, int]  # ("F", "B" or "W", microbatch): one chunk per rank, its own
Action = tuple[str, int, int]  # ("F", "B" or "W", microbatch, chunk)


def gpipe(stages: int, microbatches: int, stage: int) -> list[Step]:
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def one_f_one_b(stages: int, microbatches: int, stage: int) -> list[Step]:
    warmup = min(microbatches, stages - stage)
    order: list[Step] = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("B", i), ("F", warmup + i)]
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def zero_bubble(stages: int, microbatches: int, stage: int) -> list[Step]:
    warmup = min(stages - stage - 1, microbatches)
    order: list[Step] = [("F", i) for i in range(warmup)]
    weights = 0
    for i in range(microbatches):
        if warmup + i < microbatches:
            order.append(("F", warmup + i))
        order.append(("B", i))
        if i >= stage:  # the weights' gradient lags its input gradient by `stage` microbatches
            order.append(("W", weights))
            weights += 1
    return order + [("W", i) for i in range(weights, microbatches)]


def interleaved(ranks: int, microbatches: int, rank: int, virtual: int) -> list[Action]:
    total = microbatches * virtual
    group = ranks * virtual

    def action(kind: str, k: int) -> Action:
        local = (k % group) // ranks
        local = local if kind == "F" else virtual - 1 - local
        return (kind, (k // group) * ranks + k % ranks, local * ranks + rank)

    warmup = min(2 * (ranks - rank - 1) + (virtual - 1) * ranks, total)
    order = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action("F", warmup + k), action("B", k)]
    return order + [action("B", k) for k in range(total - warmup, total)]


ORDERS: dict[str, Callable[[int, int, int], list[Step]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zbh1": zero_bubble,
}
SCHEDULES = (*ORDERS, "interleaved_1f1b")


def stage_order(schedule: str, ranks: int, microbatches: int, rank: int, virtual: int = 1) -> list[Action]:
    """Rank ``rank``'s actions under ``schedule`` with ``virtual`` chunks per rank; an error for a schedule that
    cannot run these counts."""
    refused = refusal(schedule, ranks, microbatches, virtual)
    if refused is not None:
        raise ConfigurationError(refused)
    if schedule == "interleaved_1f1b":
        return interleaved(ranks, microbatches, rank, virtual)
    return [(kind, i, rank) for kind, i in ORDERS[schedule](ranks, microbatches, rank)]


def refusal(schedule: str, ranks: int, microbatches: int, virtual: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` on ``ranks`` with ``virtual`` chunks each (None: it can)."""
    if schedule not in SCHEDULES:
        return f"no pipeline schedule '{schedule}'; there are {', '.join(SCHEDULES)}."
    if schedule == "interleaved_1f1b":
        if virtual < 2:
            return "schedule 'interleaved_1f1b' runs several chunks per rank: set virtual_stages=2 or more."
        if microbatches % ranks:
            return (
                f"schedule 'interleaved_1f1b' takes the microbatches in groups of the ranks ({ranks}): make "
                f"microbatches a multiple of {ranks}; got {microbatches}."
            )
    elif virtual != 1:
        return f"virtual_stages={virtual} (chunks per rank) runs under schedule 'interleaved_1f1b' only."
    if schedule == "1f1b" and microbatches < ranks:
        return (
            f"schedule '1f1b' needs at least as many microbatches as stages ({ranks}); got {microbatches}. Raise "
            "microbatches, or use 'gpipe' or 'zbh1'."
        )
    return None


def label(action: Action, ranks: int) -> str:
    """``F3`` (one chunk per rank), or ``F3.c5`` (chunk 5)."""
    kind, i, chunk = action
    return f"{kind}{i}" if chunk < ranks else f"{kind}{i}.c{chunk}"


def check_orders(orders: list[list[Action]]) -> list[list[tuple[int, Action]]]:
    """Run the ranks' orders against each other (a forward waits for the chunk before, a backward for the chunk
    after and its own forward, a weight gradient for its backward); the rounds in which each action can run, as
    ``(rank, action)`` lists. Raises a ``ConfigurationError`` naming each rank's next action where none could run."""
    ranks = len(orders)
    last = max(c for order in orders for _, _, c in order)
    done: set[Action] = set()
    heads = [0] * ranks
    rounds: list[list[tuple[int, Action]]] = []

    def ready(action: Action) -> bool:
        kind, i, c = action
        if kind == "F":
            return c == 0 or ("F", i, c - 1) in done
        if kind == "W":
            return ("B", i, c) in done
        return ("F", i, c) in done and (c == last or ("B", i, c + 1) in done)

    while any(heads[r] < len(orders[r]) for r in range(ranks)):
        now = [(r, orders[r][heads[r]]) for r in range(ranks) if heads[r] < len(orders[r])]
        runnable = [(r, a) for r, a in now if ready(a)]
        if not runnable:
            waiting = ", ".join(f"rank {r} at {label(a, ranks)}" for r, a in now)
            raise ConfigurationError(f"the pipeline's orders would wait forever: {waiting}.")
        for r, action in runnable:
            done.add(action)
            heads[r] += 1
        rounds.append(runnable)
    return rounds
