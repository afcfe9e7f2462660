"""What passes build on: the step program, graph editing, ``Pass`` and ``Pipeline``, the verifiers, the collective
ops and their plans, options, the cost model, bucket layout and rendering. Imports no other layer."""
