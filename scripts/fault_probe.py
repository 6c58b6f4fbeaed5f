"""Per-run wall time and page faults of a layer's XLA composition and fused kernel on the CPU,
with one input set (the find step's regime for large ops) and with several (the benchmark's).

    python scripts/fault_probe.py NA_C256_H56 --batch 8 --dtype float32 --layout NHWC --sets 1 8

A run whose output pages are fresh from the system faults them in one by one; on a 2-core VM
that tripled XLA's time for a 25.7 MB output (BENCHMARKS.md, thirteenth session).
"""

from __future__ import annotations

import argparse
import time

import jax

from jaxfuse.bench.cases import BenchCase
from jaxfuse.bench.layers import SUITES
from jaxfuse.bench.timing import batched
from jaxfuse.measure import page_faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("layer")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="NHWC")
    parser.add_argument("--ops", default="NA")
    parser.add_argument("--sets", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    layer = next(lay for suite in SUITES.values() for lay in suite if lay.name == args.layer)
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer(layer, args.batch, args.dtype, args.layout, args.ops)
    plan, ops = case.plan(device, solver="fused")
    programs = {"xla": batched(case.unfused()), "fused": batched(case.fused(plan, ops))}
    print(f"{case.label()}: us per op / page faults, each run")
    for sets in args.sets:
        operands = case.arg_sets(sets, device)
        for name, program in programs.items():
            for _ in range(3):
                jax.block_until_ready(program(operands))
            runs = []
            for _ in range(args.runs):
                faults, start = page_faults(), time.perf_counter()
                jax.block_until_ready(program(operands))
                runs.append(f"{(time.perf_counter() - start) / sets * 1e6:.0f}/"
                            f"{page_faults() - faults}")
            print(f"{name:>5} {sets} set(s): {' '.join(runs)}")


if __name__ == "__main__":
    main()
