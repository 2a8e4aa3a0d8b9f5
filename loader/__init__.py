"""moeprep loader: the lean device runtime that executes a prepared artifact (never imports prep).

Shape legend, declared here once for both packages (``loader`` and ``prep``): T tokens, L (MoE) layers,
E experts per layer, K top-k, H hidden size, I expert intermediate size.
"""

__version__ = "0.1.0"


def load(artifact, **options):
    """Open an artifact for offloaded inference: ``loader.runtime.load`` (its options and defaults),
    imported lazily so that ``import loader`` stays cheap for the CLI and for format checks."""
    from loader.runtime import load as _load

    return _load(artifact, **options)


def preview(artifact, **options) -> dict:
    """What ``load(artifact, ...)`` would hold where and how fast it would run, without loading a weight (``moeload
    plan``): ``loader.fit.preview`` (its options and defaults). Named so because ``loader.plan`` is the plan schema's
    module."""
    from loader.fit import preview as _preview

    return _preview(artifact, **options)
