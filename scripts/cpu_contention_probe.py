"""A Flax ResNet basic block on the CPU, ``jax.jit(fuse(apply))`` against ``jax.jit(apply)``,
on an idle machine and with other processes keeping cores busy (a shared machine).

    python scripts/cpu_contention_probe.py                  # idle, then one core busy
    python scripts/cpu_contention_probe.py --busy 0 --processes 4

Each configuration runs in a fresh process (thread placement differs from one to the next,
and the slow mode this probes shows in some processes only): median per call of rounds of
25 calls, the two programs' rounds interleaved. The busy cores are spinning processes of
their own. On a 2-core VM (2026-12-07) the CPU kernels' pool workers, polling for work on
the core the caller needed, made a bf16/fp16 batch-1 block 0.80-0.86x of plain jit in some
processes (csrc/cpu/thread_pool.cc says what changed).
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys

CONFIGS = [("float16", 1), ("bfloat16", 1), ("float32", 1), ("bfloat16", 8), ("float32", 8)]


def measure(dtype_name: str, batch: int, rounds: int = 10) -> tuple[float, float]:
    """Median seconds per call of plain and fused jit of the block (this process)."""
    import time

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfuse

    dtype = jnp.dtype(dtype_name)

    class ResBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            def bn():
                return nn.BatchNorm(use_running_average=True, dtype=dtype)

            y = nn.relu(bn()(nn.Conv(32, (3, 3), use_bias=False, dtype=dtype)(x)))
            y = bn()(nn.Conv(32, (3, 3), use_bias=False, dtype=dtype)(y))
            return nn.relu(y + x)

    block = ResBlock()
    x = jax.random.normal(jax.random.key(0), (batch, 32, 32, 32)).astype(dtype)
    variables = block.init(jax.random.key(1), x)
    stats = jax.tree_util.tree_map(
        lambda a: jax.random.uniform(jax.random.key(2), a.shape, minval=0.3, maxval=2.0),
        variables["batch_stats"])
    variables = {"params": variables["params"], "batch_stats": stats}
    plain, fused = jax.jit(block.apply), jax.jit(jaxfuse.fuse(block.apply))
    for fn in (plain, fused):
        jax.block_until_ready(fn(variables, x))

    def median(fn, calls: int = 25) -> float:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            jax.block_until_ready(fn(variables, x))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    plain_s, fused_s = [], []
    for _ in range(rounds):
        plain_s.append(median(plain))
        fused_s.append(median(fused))
    return float(np.median(plain_s)), float(np.median(fused_s))


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, nargs="*", default=[0, 1],
                        help="busy cores to run with, one run each (default: 0 and 1)")
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh processes per configuration")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        plain, fused = measure(args.child[0], int(args.child[1]))
        print(f"{plain} {fused}")
        return
    print(f"{'busy':>4} {'dtype':9} {'N':>2}  plain us  fused us per process (ratio)")
    for busy in args.busy:
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
        for spinner in spinners:
            spinner.start()
        try:
            for dtype, batch in CONFIGS:
                cells = []
                for _ in range(args.processes):
                    out = subprocess.run([sys.executable, __file__, "--child", dtype, str(batch)],
                                         capture_output=True, text=True, check=True)
                    plain, fused = map(float, out.stdout.split()[-2:])
                    cells.append(f"{plain * 1e6:.0f}/{fused * 1e6:.0f} ({plain / fused:.2f}x)")
                print(f"{busy:>4} {dtype:9} {batch:>2}  " + "  ".join(cells), flush=True)
        finally:
            for spinner in spinners:
                spinner.terminate()


if __name__ == "__main__":
    main()
