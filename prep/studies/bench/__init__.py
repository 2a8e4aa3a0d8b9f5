"""``moeprep bench``: resident vs accelerate vs the loader, on the reference model and a Mixtral-shaped one.

``run.py`` orchestrates (subjects, budgets, the resident candidates, one worker process per measurement, the
device profile and the simulator's model of each loader row, the bounds, outputs), ``subjects.py`` builds what
is measured, ``worker.py`` measures one system, ``prefill.py`` the prefill rows (``--prefill``), ``report.py``
writes bench.md and bench.png, ``readme.py`` the top README's How fast block from a bench.json (``make how-fast``).
"""
