"""Benchmarks: speed and memory targets, measured and written as markdown tables (`make bench`)."""
