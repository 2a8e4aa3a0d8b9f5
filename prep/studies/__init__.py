"""Experiments over prepared artifacts (bit-width, routing, neuron, prediction, policy, kernel, bench):
imported only by `prep/cli.py`; each merges its section into an artifact's report through `prep.report`."""


def bounded(kind: type, low: float, high: float):
    """An argparse ``type``: a ``kind`` (int or float) number, finite, from ``low`` to ``high``; anything else is
    argparse's usage error naming the option (a huge count would only hang, a NaN time limit never end)."""
    import argparse
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text!r}: use a number from {low:g} to {high:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse
