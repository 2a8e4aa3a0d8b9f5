"""moeprep loader: the lean device runtime that executes a prepared artifact (never imports prep)."""

__version__ = "0.1.0"
