"""Benchmark programs: workloads, clients and reports (not tests)."""
