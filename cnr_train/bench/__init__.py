"""Shared pieces of the benchmark scripts in ``scripts/``."""
