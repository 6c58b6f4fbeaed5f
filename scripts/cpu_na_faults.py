"""Batch norm + ReLU on the CPU, fused vs jax.jit, with the minor page faults of each call.

The NA rows of the CPU benchmark are pure memory passes whose time depends mostly on whether
the allocator hands out fresh pages for the output (each first-touched 4 KiB page costs about a
microsecond on a VM). This prints time and faults per op side by side, twice each, so a reader
can see which calls paid for faults:

    python scripts/cpu_na_faults.py --layout NHWC --sets 2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse as jf


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(8, 64, 112), metavar=("N", "C", "H"))
    parser.add_argument("--layout", choices=("NHWC", "NCHW"), default="NHWC")
    parser.add_argument("--sets", type=int, default=2, help="distinct inputs per jit call")
    parser.add_argument("--repeats", type=int, default=15)
    opts = parser.parse_args()
    n, c, h = opts.shape
    shape = (n, h, h, c) if opts.layout == "NHWC" else (n, c, h, h)
    channel_axis = 3 if opts.layout == "NHWC" else 1

    plan = jf.FusionPlan(jf.TensorDesc(shape, jnp.float32, layout=opts.layout))
    bn = plan.add_batchnorm_inference("spatial")
    act = plan.add_activation_forward("relu")
    plan.compile(jax.devices("cpu")[0])
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(opts.sets)]
    scale, shift, mean, var = (jnp.asarray(rng.random(c) + 0.5, jnp.float32) for _ in range(4))
    args = jf.OperatorArgs().set_batchnorm_inference(bn, scale, shift, mean, var)
    args = args.set_activation_forward(act)

    def unfused(x: jax.Array) -> jax.Array:
        per_channel = [1] * 4
        per_channel[channel_axis] = c
        s, b, m, v = (t.reshape(per_channel) for t in (scale, shift, mean, var))
        return jax.nn.relu((x - m) * (s * jax.lax.rsqrt(v + 1e-5)) + b)

    runs = {"fused": jax.jit(lambda xs: [plan.execute(x, args) for x in xs]),
            "xla": jax.jit(lambda xs: [unfused(x) for x in xs])}
    print(f"{'':6} {'ms/op':>8} {'faults/op':>10}   shape {shape}, {opts.sets} ops per call")
    for name in ["fused", "xla", "fused", "xla"]:
        run = runs[name]
        for _ in range(3):
            jax.block_until_ready(run(xs))
        times, faults = [], []
        for _ in range(opts.repeats):
            before, start = _minor_faults(), time.perf_counter()
            jax.block_until_ready(out := run(xs))
            times.append(time.perf_counter() - start)
            faults.append(_minor_faults() - before)
            del out
        print(f"{name:6} {statistics.median(times) * 1e3 / opts.sets:8.3f} "
              f"{statistics.median(faults) / opts.sets:10.0f}")


if __name__ == "__main__":
    main()
