"""One benchmark layer's kernels, fused or as XLA runs them, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python scripts/ncu_layer.py --layer r50_l3_3x3_256 --batch 256 --which fused

Compiles the layer's fused plan (the jaxfuse kernel forced, autotuned variant) or the unfused
composition under ``jax.jit``, warms it up, and only then opens the profiler's window
(``cuProfilerStart``), so XLA's autotuning launches and the warm-up calls are not profiled.
"""

from __future__ import annotations

import argparse
import ctypes

import jax

from jaxfuse.bench.cases import BenchCase


def profiler_window(start: bool) -> None:
    """cuProfilerStart/Stop on the device's primary context (current on this thread)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) != 0 or cuda.cuCtxSetCurrent(ctx) != 0:
        raise RuntimeError("no CUDA primary context")
    status = cuda.cuProfilerStart() if start else cuda.cuProfilerStop()
    if status != 0:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned {status}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layout", default="NHWC")
    parser.add_argument("--filter-layout", default=None)
    parser.add_argument("--chain", default="CBNA")
    parser.add_argument("--filter-dtype", default=None,
                        help="float32: the plan keeps float32 filters (wdtype=f32)")
    parser.add_argument("--which", choices=["fused", "xla"], default="fused")
    parser.add_argument("--calls", type=int, default=2)
    a = parser.parse_args()

    case = BenchCase.for_layer(a.layer, a.batch, a.dtype, a.layout, a.chain, a.filter_layout,
                               a.filter_dtype)
    device = jax.devices()[0]
    args = case.arg_sets(1, device)[0]
    if a.which == "fused":
        plan, ops = case.plan(device, solver="fused")
        print("kernel:", plan.kernel_info.get("solver"), plan.kernel_info.get("variant"))
        fn = jax.jit(case.fused(plan, ops))
    else:
        fn = jax.jit(case.unfused())
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    profiler_window(True)
    for _ in range(a.calls):
        jax.block_until_ready(fn(*args))
    profiler_window(False)


if __name__ == "__main__":
    main()
