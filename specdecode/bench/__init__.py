"""Benchmarks: each measures specdecode against a baseline in the same process and reports ratios."""
