"""Ceilings measured on the device at hand, and the roofline floor of an op."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .timing import batched, wall_time_per_op

__all__ = ["Ceilings", "measure_ceilings"]


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Copy bandwidth (bytes read + written per second) and matrix rates (flop/s)."""

    copy_bandwidth: float
    matmul: dict[str, float]  # "float16", "bfloat16", "float32" (TF32 allowed), "float32_exact"

    def floor(self, flops: int, min_bytes: int, dtype: str, exact_fp32: bool = False) -> float:
        """max(bytes / bandwidth, flops / peak) in seconds."""
        key = "float32_exact" if dtype == "float32" and exact_fp32 else dtype
        compute = flops / self.matmul[key] if flops else 0.0
        return max(min_bytes / self.copy_bandwidth, compute)


def measure_ceilings(device: jax.Device, matmul_size: int | None = None) -> Ceilings:
    """Measures copy bandwidth and matrix-product rates on `device`."""
    gpu = device.platform == "gpu"
    elements = (1 << 28) if gpu else (1 << 24)  # 1 GiB / 64 MiB of float32
    key = jax.random.key(0)
    xs = [jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (elements,)), device)
          for i in range(2)]
    copy = wall_time_per_op(batched(lambda x: x * 1.5), [(x,) for x in xs], repeats=10)
    bandwidth = 2 * elements * 4 / copy
    size = matmul_size or (8192 if gpu else 1024)
    rates = {}
    for name, dtype, precision in (("float16", jnp.float16, None),
                                   ("bfloat16", jnp.bfloat16, None),
                                   ("float32", jnp.float32, None),
                                   ("float32_exact", jnp.float32, lax.Precision.HIGHEST)):
        mats = [jax.device_put(jax.random.normal(jax.random.fold_in(key, 10 + i),
                                                 (size, size), dtype), device)
                for i in range(4)]
        pairs = [(mats[0], mats[1]), (mats[2], mats[3])]
        t = wall_time_per_op(batched(lambda a, b, p=precision: jnp.matmul(a, b, precision=p)),
                             pairs, repeats=5)
        rates[name] = 2 * size**3 / t
    return Ceilings(bandwidth, rates)
