"""Solve stage: choose the fastest plan that fits (CP-SAT), with a brute-force reference for tests."""
