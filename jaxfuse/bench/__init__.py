"""Benchmark models and tools for jaxfuse."""
