"""Throughput benchmarks (not tests): each script prints JSON and saves it under ``benchmarks/results/``."""
