"""Experiments that ship with the CLI (``swarm sweep``) and ``exp/``: sweeps, benchmark
suites, the numbers of a finished job and the sweep's plot. Nothing in the leader or the
agent imports this package."""
