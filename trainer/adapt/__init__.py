"""Adaptation daemons: they read verifier logs and publish better drafting state for the servers to load."""
