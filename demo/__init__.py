"""``forewarn demo``: the whole product on one machine, telling its story with real processes.

- :mod:`demo.cli` — the command: starts the parts, runs the story, prints the summary, serves;
- :mod:`demo.story` — the scenario (preventive move, unplanned recovery, bitwise check);
- :mod:`demo.gpt` — the migratable training job it runs (also ``examples/train_gpt.py``).

The demo uses nothing of the service's code: only the ``forewarn`` command line and the REST API,
the way an operator's script would.
"""
