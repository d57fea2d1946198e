"""Benchmarks: PolyGateway against what a user would pick instead, side by side in one run.

``python -m bench`` (``make bench``) starts the simulated upstream and a
private ``redis-server`` on one core, runs every configuration in a fresh
client process on the other core (``python -m bench.run_one``), interleaves
the configurations over several rounds, takes medians and writes
``research-wiki/BENCHMARKS.md``. Client CPU seconds per call come first: it
is the figure a noisy machine disturbs least.
"""
