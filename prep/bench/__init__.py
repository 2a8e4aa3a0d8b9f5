"""``moeprep bench``: resident vs accelerate vs the loader, on the reference model and a Mixtral-shaped one.

``run.py`` orchestrates (subjects, budgets, one worker process per measurement, outputs), ``subjects.py``
builds what is measured, ``worker.py`` measures one system, ``report.py`` writes bench.md and bench.png.
"""
