"""Benchmarks: fused plans against ``jax.jit`` of the unfused composition (``python -m
jaxfuse.bench``), with the roofline floor from ceilings measured in the same run; and the Flax
models (``models``) the end-to-end benchmarks and examples use."""
