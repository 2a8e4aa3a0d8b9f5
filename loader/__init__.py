"""moeprep loader: the lean device runtime that executes a prepared artifact (never imports prep)."""

__version__ = "0.1.0"


def load(artifact, device: str = "cpu", memory_budget=None, store: str = "disk", **options):
    """Open an artifact for offloaded inference; see ``loader.runtime.load`` (imported lazily so that
    ``import loader`` stays cheap for the CLI and for format checks)."""
    from loader.runtime import load as _load

    return _load(artifact, device=device, memory_budget=memory_budget, store=store, **options)
