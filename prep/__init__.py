"""moeprep: offline preparation toolkit for running Mixture-of-Experts models on edge devices."""

__version__ = "0.1.0"
