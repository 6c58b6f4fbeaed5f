"""What a GPU find step's input sets cost and what they buy, by their number.

    python scripts/sets_probe.py --layer mb2_dw_7_960 --dtype bfloat16 --layout NHWC \\
        --batch 256 --sets 1 2 3 5

For each set count, in a process of its own (XLA's autotuning results are a process's), as
``find._measure`` does it: draws the sets, compiles XLA's candidate and the fused kernel's
(the form the find step times) into their timing programs, loads them (their first run),
times both (``Harness.run``), compiles and loads XLA's program once more (its autotuning
then cached), and prints the seconds each step took and the microseconds per set of each
candidate.

Why: on an H100 (2026-12-07) XLA's candidate for MobileNetV2's mb2_dw_7_960 chain at batch
256 took 1.0-1.27 s to load in bf16 NHWC (5 sets) and 0.33-0.42 s in fp32 NCHW (2 sets), the
other depthwise chains 0.15-0.23 s with one set and 0.56-0.67 s with three: about 0.2 s a set,
as if cuDNN built a plan for each convolution of the program. That load holds the device,
the kernel's autotuner waits for it, and it puts that chain's selection at 1.7-2.9 s. Fewer
sets would cost less if the times per set stay where they are (the sets exist so that each
run reads its operands from memory, not from the L2 cache). Measured with this probe on an
H100 (2026-12-07, BENCHMARKS.md): 0.12-0.16 s a set, again in every new executable, for the
depthwise chains only, and times a set within 2% from 2 sets to 5 (measure._GPU_CACHE_COVER).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def probe(layer: str, dtype: str, layout: str, batch: int, chain: str, sets: int) -> dict:
    """One set count's steps and times, in this process."""
    import jax

    from jaxfuse import find, measure, solvers
    from jaxfuse.bench.cases import BenchCase

    device = jax.devices()[0]
    plan, _ = BenchCase.for_layer(layer, batch, dtype, layout, chain).plan(device,
                                                                           solver="fused")
    signature = plan.signature
    kernel = solvers.prepare_fused(signature, device)
    row: dict = {"sets": sets, "default_sets": measure.set_count(signature, device),
                 "device": device.device_kind}
    start = time.perf_counter()
    operands = measure.random_operands(signature, device, sets)
    jax.block_until_ready(operands)
    row["draw_s"] = time.perf_counter() - start
    candidates = {"xla": find.xla_function(signature),
                  "fused": solvers.fused_function(signature, filters=kernel.filters,
                                                  layout=kernel.input_layout)}
    for name, fn in candidates.items():
        start = time.perf_counter()
        harness = measure.Harness.compile(fn, operands, device)
        row[f"{name}_compile_s"] = time.perf_counter() - start
        start = time.perf_counter()
        harness.load()
        row[f"{name}_load_s"] = time.perf_counter() - start
        _, timing = harness.run()
        row[f"{name}_device_us"] = timing.device * 1e6
        row[f"{name}_host_us"] = timing.host * 1e6
    # The same program compiled and loaded again, as a new executable: what is left of the
    # compile once XLA's autotuning results are cached (as they are for the program that
    # jax.jit compiles next in this process), and whether the load repeats per executable.
    start = time.perf_counter()
    again = measure.Harness.compile(find.xla_function(signature), operands, device)
    row["xla_again_compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    again.load()
    row["xla_again_load_s"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layer", default="mb2_dw_7_960")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layout", default="NHWC")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chain", default="CBNA")
    parser.add_argument("--sets", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        print(json.dumps(probe(a.layer, a.dtype, a.layout, a.batch, a.chain, a.sets[0])))
        return
    print(f"{a.layer} {a.dtype} {a.layout} batch {a.batch} {a.chain}: a process a row")
    print(f"{'sets':>4} {'draw s':>7} {'xla comp':>8} {'xla load':>8} {'xla us':>8} "
          f"{'fus comp':>8} {'fus load':>8} {'fused us':>8} {'again c':>8} {'again l':>8}",
          flush=True)
    for count in a.sets:
        command = [sys.executable, __file__, "--child", "--layer", a.layer, "--dtype", a.dtype,
                   "--layout", a.layout, "--batch", str(a.batch), "--chain", a.chain,
                   "--sets", str(count)]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"{count:>4} failed (exit {done.returncode}): {tail[:200]}", flush=True)
            continue
        r = json.loads(lines[-1])
        print(f"{count:>4} {r['draw_s']:7.2f} {r['xla_compile_s']:8.2f} {r['xla_load_s']:8.2f} "
              f"{r['xla_device_us']:8.1f} {r['fused_compile_s']:8.2f} {r['fused_load_s']:8.2f} "
              f"{r['fused_device_us']:8.1f} {r['xla_again_compile_s']:8.2f} "
              f"{r['xla_again_load_s']:8.2f}   (the find step's own count: "
              f"{r['default_sets']}; {r['device']})", flush=True)


if __name__ == "__main__":
    main()
