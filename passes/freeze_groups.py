"""``freeze-groups``: one program variant of gradient freezing (MindSpore Boost ``GradientFreeze``).

Requires: traced gradients (run it first, before accumulation and reduction).
Guarantees: the trainable parameters, in model order, are split into
``groups`` consecutive groups of near-equal counts (group ``j`` holds
positions ``round(j*P/groups)`` to ``round((j+1)*P/groups)``). The
parameters of groups ``< index`` get no gradient, no reduction and no update:
their gradients lose their tag, their parameter and optimizer-state outputs
return the inputs, and dead code elimination then removes every backward op
that only they needed (the truncated backward). ``index=0`` trains everything
and changes nothing. Which index runs at which step is the schedule's choice
(``transpiler/strategies/schedules.py``, ``FreezeSchedule``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.program import StepProgram

from .gradient_flow import gradient_nodes, keep_inputs
from .partitions import check_part, group_bounds


@dataclass(frozen=True)
class FreezeGroups(Pass):
    name = "freeze-groups"
    requires = frozenset({Fact.FUNCTIONAL, Fact.UNREDUCED, Fact.UNACCUMULATED, Fact.UNTOUCHED, Fact.UNFLATTENED})
    summary = "gradient freeze: parameter groups before `index` get no gradient, reduction or update"
    groups: int = option(2, minimum=1, help="consecutive parameter groups in model order")
    index: int = option(0, minimum=0, help="groups 0..index-1 are frozen in this variant")

    def run(self, program: StepProgram) -> bool:
        names = list(program.param_groups)  # every trainable parameter in model order, flat ones too
        check_part("freeze_groups", self.groups, "freeze index", self.index, len(names))
        frozen = set(names[: group_bounds(len(names), self.groups)[self.index]])
        hit = [g for g in gradient_nodes(program) if g.meta["grad_of"] in frozen]
        if not hit:
            return False
        for grad in hit:
            del grad.meta["grad_of"]
        keep_inputs(program, ("param", "state"), frozen)
        return True
