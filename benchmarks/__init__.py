"""Offline benchmarks (run as modules: python -m benchmarks.offline_throughput)."""
