"""Experiments over prepared artifacts (bit-width, routing, neuron, prediction, policy, kernel, bench):
imported only by `prep/cli.py`; each merges its section into an artifact's report through `prep.report`."""
