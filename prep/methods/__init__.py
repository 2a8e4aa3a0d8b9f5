"""Algorithms that know no stage, recipe or report: tracing, routing statistics, sensitivity, Fisher,
neuron profiling, the first-layer gate, the cache allocation, decoded weights."""
