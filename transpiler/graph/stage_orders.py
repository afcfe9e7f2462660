"""Pipeline schedules as orders: what each stage runs, microbatch by microbatch, in one step.

An order is a list of actions ``("F", i)`` (the forward of microbatch ``i``) and ``("B", i)`` (its backward); a
zero-bubble order splits the backward into ``("B", i)``, the gradient of the stage's input (which the stage
before waits for), and ``("W", i)``, the gradients of its weights (which nobody waits for). A stage's program runs
its actions in that order; a forward receives its input from the stage before, a backward its output's gradient
from the stage after, and sends never wait. The schedules change the order of work, never the arithmetic: the
weights' gradients are made in microbatch order, so they add up in the same order under all of them.

- ``gpipe``: every forward, then every backward (torch's ``ScheduleGPipe``).
- ``1f1b``: stage ``s`` of ``p`` runs ``min(m, p - s)`` forwards, then one backward and one forward in turn, then
  the backwards left (torch's ``Schedule1F1B``; it holds at most ``p - s`` microbatches' activations, GPipe ``m``).
- ``zbh1``: zero bubble (Qi et al., ICLR 2024, the ZB-H1 rule): a stage runs an input gradient as soon as it can,
  else a forward while fewer than ``p - s`` microbatches await their input gradient, else the oldest weight
  gradient left, else waits; the orders come from running that rule on all stages at once, each action one unit
  of time. With forward, input and weight gradients alike, a stage idles ``p - 1`` units of ``3m + p - 1``
  (1F1B: ``3(p - 1)`` of ``3(m + p - 1)``). Deferred weight gradients keep their microbatches' activations longer
  than 1F1B does.

:func:`check_orders` runs the stages' orders against each other and raises where one would wait forever.
"""

from __future__ import annotations

from collections.abc import Callable

from transpiler.errors import ConfigurationError

Action = tuple[str, int]  # ("F" or "B", microbatch)


def gpipe(stages: int, microbatches: int, stage: int) -> list[Action]:
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def one_f_one_b(stages: int, microbatches: int, stage: int) -> list[Action]:
    warmup = min(microbatches, stages - stage)
    order: list[Action] = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("B", i), ("F", warmup + i)]
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def zero_bubble(stages: int, microbatches: int, stage: int) -> list[Action]:
    orders: list[list[Action]] = [[] for _ in range(stages)]
    done: set[tuple[int, Action]] = set()
    forwards, backwards, weights = [0] * stages, [0] * stages, [0] * stages
    while any(w < microbatches for w in weights):
        now = []
        for s in range(stages):
            f, b, w = forwards[s], backwards[s], weights[s]
            if b < f and (s == stages - 1 or (s + 1, ("B", b)) in done):
                now.append((s, ("B", b)))
            elif f < microbatches and f - b < stages - s and (s == 0 or (s - 1, ("F", f)) in done):
                now.append((s, ("F", f)))
            elif w < b:
                now.append((s, ("W", w)))
        for s, action in now:
            done.add((s, action))
            orders[s].append(action)
            counts = {"F": forwards, "B": backwards, "W": weights}[action[0]]
            counts[s] += 1
    return orders[stage]


ORDERS: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zbh1": zero_bubble,
}


def stage_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s actions under ``schedule``; an error for a schedule that cannot run these counts."""
    if schedule not in ORDERS:
        raise ConfigurationError(f"no pipeline schedule '{schedule}'; there are {', '.join(ORDERS)}.")
    if schedule == "1f1b" and microbatches < stages:
        raise ConfigurationError(
            f"schedule '1f1b' needs at least as many microbatches as stages ({stages}); got {microbatches}. Raise "
            "microbatches, or use 'gpipe' or 'zbh1'."
        )
    return ORDERS[schedule](stages, microbatches, stage)


def check_orders(orders: list[list[Action]]) -> list[list[tuple[int, Action]]]:
    """Run the stages' orders against each other (a forward waits for the stage before, a backward for the stage after
    and its own forward, a weight gradient for its backward); the rounds in which each action can run, as ``(stage,
    action)`` lists. Raises a ``ConfigurationError`` naming each stage's next action where none could run."""
    stages = len(orders)
    done: set[tuple[int, Action]] = set()
    heads = [0] * stages
    rounds: list[list[tuple[int, Action]]] = []

    def ready(s: int, action: Action) -> bool:
        kind, i = action
        if kind == "F":
            return s == 0 or (s - 1, ("F", i)) in done
        if kind == "W":
            return (s, ("B", i)) in done
        return (s, ("F", i)) in done and (s == stages - 1 or (s + 1, ("B", i)) in done)

    while any(heads[s] < len(orders[s]) for s in range(stages)):
        now = [(s, orders[s][heads[s]]) for s in range(stages) if heads[s] < len(orders[s])]
        runnable = [(s, a) for s, a in now if ready(s, a)]
        if not runnable:
            waiting = ", ".join(f"stage {s} at {kind}{i}" for s, (kind, i) in now)
            raise ConfigurationError(f"the pipeline's orders would wait forever: {waiting}.")
        for s, action in runnable:
            done.add((s, action))
            heads[s] += 1
        rounds.append(runnable)
    return rounds
