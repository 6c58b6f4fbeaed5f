"""How the find step's CPU choice for plans without a convolution depends on its input sets.

    python scripts/cpu_sets_probe.py [--sets 16] [--repeats 3]

Runs ``find._measure`` (XLA's loop against the fused kernel, as a plan's compile does) a few
times for each fp32/fp16 NA chain of the benchmark at batch 1, with the set count
``measure.set_count`` gives (or `--sets`), and prints both times and the choice each time:
compare with ``python -m jaxfuse.bench --platform cpu --suite na --batch 1``. On the 2-core VM
(2026-11-27) one set timed XLA's loop 1.3-2x slower than the benchmark's 16 sets did.
"""

from __future__ import annotations

import argparse

import jax

from jaxfuse import find, measure, solvers
from jaxfuse.bench.cases import BenchCase

CHAINS = [(layer, dtype, layout) for layer in ("NA_C64_H112", "NA_C256_H56", "NA_C1024_H14")
          for dtype in ("float32", "float16") for layout in ("NHWC", "NCHW")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", type=int, default=0, help="input sets (0: set_count's)")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    if opts.sets:
        find.set_count = lambda signature, device: opts.sets
    device = jax.devices("cpu")[0]
    for layer, dtype, layout in CHAINS:
        plan, _ = BenchCase.for_layer(layer, 1, dtype, layout, "NA").plan(device, solver="fused")
        signature = plan.signature
        kernel = solvers.prepare_fused(signature, device)
        runs = []
        for _ in range(opts.repeats):
            decision = find._measure(signature, device, kernel)
            times = dict(decision.times_us)
            runs.append(f"{times['xla']:7.1f} / {times['fused']:7.1f} {decision.solver}")
        sets = opts.sets or measure.set_count(signature, device)
        print(f"{layer:13s} {dtype:8s} {layout} {sets:2d} sets, xla / fused us: "
              + " | ".join(runs), flush=True)


if __name__ == "__main__":
    main()
