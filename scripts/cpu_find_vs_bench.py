"""Where the CPU find step and the layer benchmark disagree about a convolution chain.

    python scripts/cpu_find_vs_bench.py --batch 1 --dtype float16 --layout NCHW \
        mb2_pw_112_16_96 r50n_56_64_256

For each layer: the find step's two candidate times (``find._measure``, as a plan's compile
runs it, twice), then the benchmark's programs (the user's composition and the forced fused
kernel, K sets in one jit, timed in turns, fastest run) with the benchmark's K sets and with
the find step's set count, one op after another (``--chained``: each op waits for the one
before, as a network's layers do). On the 2-core VM (2026-11-28) the benchmark timed XLA's
composition of mb2_pw_112_16_96 fp16 NCHW at batch 1 at 2297 us where the find step timed
715 us, and the fused kernel at 952 and 800 us: the find step left to XLA a chain the
benchmark ran 2.4x faster fused.
"""

from __future__ import annotations

import argparse

import jax

from jaxfuse import find, measure, solvers
from jaxfuse.bench.cases import BenchCase
from jaxfuse.bench.timing import batched, wall_times_interleaved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layers", nargs="+")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--layout", default="NCHW")
    parser.add_argument("--chain", default="CBNA")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chained", action="store_true")
    opts = parser.parse_args()
    device = jax.devices("cpu")[0]
    for name in opts.layers:
        case = BenchCase.for_layer(name, opts.batch, opts.dtype, opts.layout, opts.chain)
        plan, ops = case.plan(device, solver="fused")
        signature = plan.signature
        kernel = solvers.prepare_fused(signature, device)
        found = []
        for _ in range(2):
            times = dict(find._measure(signature, device, kernel).times_us)
            found.append(f"{times.get('xla', 0):7.0f} / {times.get('fused', 0):7.0f}")
        find_sets = measure.set_count(signature, device)
        bench_sets = 16 if opts.batch == 1 else 8
        print(f"{case.label()}: find step ({find_sets} sets) xla / fused us: "
              + " | ".join(found), flush=True)
        for sets in dict.fromkeys((bench_sets, find_sets, 1)):
            args = case.arg_sets(sets, device)
            programs = {"xla": batched(case.unfused(), opts.chained),
                        "fused": batched(case.fused(plan, ops), opts.chained)}
            times = wall_times_interleaved(programs, args, opts.repeats, statistic=min)
            print(f"    benchmark, {sets:2d} sets: xla {times['xla'] * 1e6:7.0f} us, fused "
                  f"{times['fused'] * 1e6:7.0f} us, xla/fused "
                  f"{times['xla'] / times['fused']:.2f}", flush=True)


if __name__ == "__main__":
    main()
