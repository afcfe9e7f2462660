"""What passes build on: the step program and its ports (the kinds, the names of pass-added state, the rules that
make it), graph editing, ``Pass`` with the facts it requires and ensures, and ``Pipeline``, the verifiers, the
collective ops and their plans, options, rank layouts, the cost model, bucket layout and rendering. Imports no
other layer."""
