"""Pipeline stages: one module each, with VERSION, a ``run`` function and the result it writes."""
