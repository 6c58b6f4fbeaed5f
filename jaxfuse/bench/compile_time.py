"""``python -m jaxfuse.bench.compile_time``: how long ``plan.compile()`` takes — cold (runtime
compiler), from the disk cache in a second process, and from memory — and the per-call host
overhead of an executed plan next to a one-op XLA program of the same size.

Each cold/disk measurement runs in its own process with its own cache directory, so nothing is
warm that a user's first run would not have warm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from ..descriptors import ConvDesc, TensorDesc
from ..plan import FusionPlan
from .timing import wall_time_per_op

# Representative plans: (name, input NHWC shape, filter HWIO shape or None, groups, ops).
PLANS = [
    ("CBNA 3x3 64->64 N=8", (8, 56, 56, 64), (3, 3, 64, 64), 1, "CBNA"),
    ("CBNA 1x1 512->2048 N=8", (8, 7, 7, 512), (1, 1, 512, 2048), 1, "CBNA"),
    ("CBNA 7x7/2 stem N=8", (8, 224, 224, 3), (7, 7, 3, 64), 1, "CBNA"),
    ("CNA depthwise 3x3 N=8", (8, 56, 56, 128), (3, 3, 1, 128), 128, "CNA"),
    ("NA N=8", (8, 56, 56, 256), None, 1, "NA"),
]


def build(shape: tuple[int, ...], filt: tuple[int, ...] | None, groups: int, ops: str,
          dtype: str = "float16") -> FusionPlan:
    plan = FusionPlan(TensorDesc(shape, dtype, "NHWC"))
    for letter in ops:
        if letter == "C":
            stride = 2 if filt[0] == 7 else 1
            plan.add_conv_forward(ConvDesc(stride, "SAME", 1, groups),
                                  TensorDesc(filt, dtype, "HWIO"))
        elif letter == "B":
            plan.add_bias_forward(TensorDesc((plan.output_desc.dim("C"),), "float32"))
        elif letter == "N":
            plan.add_batchnorm_inference("spatial")
        elif letter == "A":
            plan.add_activation_forward("relu")
    return plan


def child() -> None:
    """Compiles every plan once, then again from memory; prints JSON timings (ms)."""
    jax.devices()  # backend start-up is not plan compilation
    out: dict[str, Any] = {}
    for name, shape, filt, groups, ops in PLANS:
        start = time.perf_counter()
        plan = build(shape, filt, groups, ops).compile()
        first = time.perf_counter() - start
        start = time.perf_counter()
        build(shape, filt, groups, ops).compile()
        out[name] = {"first_ms": first * 1e3, "memory_ms": (time.perf_counter() - start) * 1e3,
                     "solver": plan.solver}
    print(json.dumps(out))


def _run_child(cache: str) -> dict[str, Any]:
    env = {**os.environ, "JAXFUSE_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-P", "-m", "jaxfuse.bench.compile_time", "--child"],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_overhead_us(repeats: int = 2000) -> dict[str, float]:
    """Median wall time per call (dispatch + a tiny kernel) of a jitted fused plan and of a
    jitted one-op XLA program on the same tiny input."""
    x = jax.device_put(np.ones((1, 8, 8, 16), np.float32))
    plan = build((1, 8, 8, 16), None, 1, "A", "float32").compile()
    from ..args import OperatorArgs

    args = OperatorArgs().set_activation_forward(plan.ops[0])
    fused = jax.jit(lambda x: plan.execute(x, args))
    xla = jax.jit(lambda x: jax.nn.relu(x))
    # One call per "op": the per-call cost is what is measured, dispatch included.
    return {name: wall_time_per_op(lambda sets, fn=fn: fn(*sets[0]), [(x,)], repeats) * 1e6
            for name, fn in (("fused_plan_us", fused), ("xla_op_us", xla))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench.compile_time",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return 0
    with tempfile.TemporaryDirectory() as cache:
        cold, disk = _run_child(cache), _run_child(cache)
    print(f"{'plan':<28} {'solver':<15} {'cold ms':>8} {'disk ms':>8} {'memory ms':>10}")
    for name in cold:
        print(f"{name:<28} {cold[name]['solver']:<15} {cold[name]['first_ms']:8.1f} "
              f"{disk[name]['first_ms']:8.1f} {cold[name]['memory_ms']:10.3f}")
    overhead = host_overhead_us()
    print(f"per-call wall time, tiny input: fused plan {overhead['fused_plan_us']:.1f} us, "
          f"one-op XLA program {overhead['xla_op_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
