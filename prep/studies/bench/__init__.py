"""``moeprep bench``: resident vs accelerate vs the loader, on the reference model and a Mixtral-shaped one.

``run.py`` runs the steps in order: ``plan.py`` (options, budgets, the subjects built and the runs listed),
``measure.py`` (the read bandwidth, the resident candidates, one worker process per measurement in interleaved
rounds, the rows and the prefill rows), ``model.py`` (the device profile and the simulator's model of each loader
row), ``bound.py`` (the physical bounds and each row's share of them), then writes the outputs. ``subjects.py``
builds what is measured and holds the registry (``SUBJECTS``: each subject's builder, systems and notes, declared
once), ``worker.py`` measures one system, ``prefill.py`` the prefill rows (``--prefill``), ``report.py`` writes
bench.md and bench.png, ``readme.py`` the top README's How fast block from a bench.json (``make how-fast``).
"""
