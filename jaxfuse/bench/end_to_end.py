"""``python -m jaxfuse.bench.end_to_end``: a whole Flax network's inference forward pass, jitted,
with every conv chain fused by :func:`jaxfuse.fuse`, against the same model under plain
``jax.jit`` — per batch size and dtype, in the same run.

Time per forward: wall time of several calls issued back to back (dispatch overlaps the device
work, as in a serving loop), median of repeats; on GPUs also the kernels' device time from a
profiler trace. The outputs are compared too.

    python -m jaxfuse.bench.end_to_end --model resnet50 --batch 1 8 64 --dtype float16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import fuse, fusion_report
from .models import mobilenet, random_variables, resnet50
from .timing import device_time_per_op

MODELS = {"resnet50": resnet50, "mobilenet": mobilenet}


def forward_seconds(fn: Any, args: tuple[Any, ...], calls: int = 10, repeats: int = 7) -> float:
    """Median over repeats of (time of `calls` back-to-back calls) / calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def run(model_name: str, batch: int, dtype: str, size: int, device: Any) -> dict[str, Any]:
    model = MODELS[model_name](dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((batch, size, size, 3)).astype(dtype), device)
    variables = jax.device_put(random_variables(model, x), device)
    report = fusion_report(model.apply, variables, x)
    plain = jax.jit(model.apply)
    fused = jax.jit(fuse(model.apply))
    start = time.perf_counter()
    y_fused = jax.block_until_ready(fused(variables, x))  # traces, compiles every plan
    first_call = time.perf_counter() - start
    y_plain = plain(variables, x)
    a, b = np.asarray(y_fused, np.float64), np.asarray(y_plain, np.float64)
    row = {
        "model": model_name, "batch": batch, "dtype": dtype, "image": size,
        "fused_groups": len(report.fused), "left_alone": len(report.left_alone),
        "first_fused_call_s": first_call,
        "rel_diff_vs_plain": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
        "plain_ms": forward_seconds(plain, (variables, x)) * 1e3,
        "fused_ms": forward_seconds(fused, (variables, x)) * 1e3,
    }
    row["speedup"] = row["plain_ms"] / row["fused_ms"]
    if device.platform == "gpu":
        sets = [(variables, x)]
        pd = device_time_per_op(jax.jit(lambda s: [plain(*a) for a in s]), sets)
        fd = device_time_per_op(jax.jit(lambda s: [fused(*a) for a in s]), sets)
        if pd and fd:
            row.update(plain_device_ms=pd * 1e3, fused_device_ms=fd * 1e3,
                       speedup_device=pd / fd)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench.end_to_end",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["resnet50"], choices=sorted(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--platform", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    rows = []
    for name in args.model:
        for dtype in args.dtype:
            for batch in args.batch:
                rows.append(run(name, batch, dtype, args.image, device))
                r = rows[-1]
                print(f"{name} N={batch} {dtype}: plain {r['plain_ms']:.2f} ms, fused "
                      f"{r['fused_ms']:.2f} ms ({r['speedup']:.2f}x); device "
                      f"{r.get('plain_device_ms', float('nan')):.2f} vs "
                      f"{r.get('fused_device_ms', float('nan')):.2f} ms; "
                      f"{r['fused_groups']} chains fused, {r['left_alone']} left; first call "
                      f"{r['first_fused_call_s']:.1f} s; diff {r['rel_diff_vs_plain']:.1e}",
                      file=sys.stderr)
    print(f"{'model':<10} {'N':>3} {'dtype':<9} {'plain ms':>9} {'fused ms':>9} {'speedup':>8} "
          f"{'dev plain':>9} {'dev fused':>9} {'dev x':>6}")
    for r in rows:
        print(f"{r['model']:<10} {r['batch']:>3} {r['dtype']:<9} {r['plain_ms']:9.2f} "
              f"{r['fused_ms']:9.2f} {r['speedup']:8.2f} {r.get('plain_device_ms', 0):9.2f} "
              f"{r.get('fused_device_ms', 0):9.2f} {r.get('speedup_device', 0):6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
