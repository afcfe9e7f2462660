"""What turns a mode name and its options into passes and a schedule, as data: the strategy and what one rank
needs of it (``strategy.py``), the recipes by family (``data_parallel.py``, ``local_updates.py``, ``diloco.py``),
the option tables they share (``options.py``), the checks at ``transpile()`` (``checks.py``), the wrapping
strategies (``composition.py``), the schedules (``schedules.py``) and the table of modes (``modes.py``)."""
