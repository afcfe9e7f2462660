"""The planner: describe the cluster, get the layout (docs/planner.md). ``plan(model, optimizer, loss_fn, batch,
cluster)`` prices every layout of the space on a cost model taken from one trace of the step and the cluster's
links, and ranks those that fit; ``transpiler plan`` prints the table, ``transpiler calibrate`` measures a
cluster."""

from .candidates import Candidate, Rejected
from .cluster import Cluster, ComputeTimes, Link, simple_cluster
from .costs import MEASURED_STEPS_FACTORS, STEPS_FACTORS, Estimate, Layout
from .profile import StepProfile, profile_step
from .search import Plan, plan

__all__ = [
    "MEASURED_STEPS_FACTORS",
    "STEPS_FACTORS",
    "Candidate",
    "Cluster",
    "ComputeTimes",
    "Estimate",
    "Layout",
    "Link",
    "Plan",
    "Rejected",
    "StepProfile",
    "plan",
    "profile_step",
    "simple_cluster",
]
