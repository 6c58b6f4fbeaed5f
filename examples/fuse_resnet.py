"""Fuse a Flax ResNet-50 and a MobileNetV2-style network with ``jaxfuse.fuse``.

For each model: print what was fused (``jaxfuse.fusion_report``), check that the fused model
computes what the unfused one does, and time both under ``jax.jit`` (median of repeats), and
the fused one as an inference server would run it, its variables closed over.

    python examples/fuse_resnet.py              # 64x64 images, batch 1 (well under a minute)
    python examples/fuse_resnet.py --full       # 224x224 images, batch 8
    python examples/fuse_resnet.py --dtype bfloat16 --verbose
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from jaxfuse.bench.models import mobilenet, random_variables, resnet50

# In float32, fused and unfused results differ by rounding only; this bound is far above that
# and catches a wrong rewrite. In float16/bfloat16 fifty layers of rounding make both drift from
# the float32 network, so there the fused model must drift no further than the unfused one does.
FLOAT32_BOUND = 1e-4
DRIFT_SLACK = 1.25


def relative_error(got: jax.Array, want: jax.Array) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(name: str, model: Any, x: jax.Array, repeats: int, verbose: bool) -> None:
    variables = random_variables(model, x)

    report = jaxfuse.fusion_report(model.apply, variables, x)
    print(f"\n== {name}: input {x.shape} {x.dtype}")
    print(report if verbose else report.summary())

    unfused = jax.jit(model.apply)
    fused = jax.jit(jaxfuse.fuse(model.apply))
    if x.dtype == jnp.float32:
        error = relative_error(fused(variables, x), unfused(variables, x))
        ok = error <= FLOAT32_BOUND
        print(f"relative error fused vs unfused: {error:.2e} ({'ok' if ok else 'MISMATCH'})")
    else:
        truth = jax.jit(model.clone(dtype=jnp.float32).apply)(variables, x.astype(jnp.float32))
        drift_unfused = relative_error(unfused(variables, x), truth)
        drift_fused = relative_error(fused(variables, x), truth)
        ok = drift_fused <= DRIFT_SLACK * drift_unfused
        print(f"relative error vs the float32 model: unfused {drift_unfused:.2e}, fused "
              f"{drift_fused:.2e} ({'ok' if ok else 'MISMATCH'})")
    # Serving: the variables closed over, constants of the program. fuse prepares them when
    # it traces (batch norms folded, filters converted) and JAX passes one argument a call.
    fuse_apply = jaxfuse.fuse(model.apply)
    served = jax.jit(lambda x: fuse_apply(variables, x))
    t_unfused = median_seconds(unfused, variables, x, repeats=repeats)
    t_fused = median_seconds(fused, variables, x, repeats=repeats)
    t_served = median_seconds(served, x, repeats=repeats)
    print(f"time per call (jit, median of {repeats}): unfused {t_unfused * 1e3:.2f} ms, "
          f"fused {t_fused * 1e3:.2f} ms, speedup {t_unfused / t_fused:.2f}x; variables "
          f"closed over {t_served * 1e3:.2f} ms")
    if not ok:
        raise SystemExit(f"{name}: fused output differs from the unfused model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="full size: 224x224 images, batch 8")
    parser.add_argument("--size", type=int, default=None, help="image height and width")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--verbose", action="store_true", help="print every fused chain")
    args = parser.parse_args()
    size = args.size or (224 if args.full else 64)
    batch = args.batch or (8 if args.full else 1)
    dtype = jnp.dtype(args.dtype)
    x = jax.random.normal(jax.random.key(2), (batch, size, size, 3), dtype)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    run("ResNet-50", resnet50(dtype=dtype), x, args.repeats, args.verbose)
    run("MobileNetV2", mobilenet(dtype=dtype), x, args.repeats, args.verbose)


if __name__ == "__main__":
    main()
