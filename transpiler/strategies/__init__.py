"""What turns a mode's config into passes and a schedule, as data: one frozen config class per mode
(``data_parallel.py``, ``local_updates.py``, ``diloco.py``) on a common base (``config.py``, ``mode_config.py``),
the features a mode takes as fields (``features.py``) and how they wrap its pipeline (``composition.py``), the
modes by name (``modes.py``) with the names of before (``legacy.py``), the strategy and what one rank needs of it
(``strategy.py``), the checks at ``transpile()`` (``checks.py``) and the schedules (``schedules.py``)."""
