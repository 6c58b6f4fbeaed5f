"""``python -m jaxfuse.bench``: fused plans against ``jax.jit`` of the unfused composition.

For every case it prints both per-op times (wall: K distinct inputs in one jit, median of
repeats; device: GPU kernel time from a profiler trace), the ratio XLA / fused, the fused op's
achieved TFLOP/s and GB/s, and the roofline floor from ceilings measured in the same run. It
checks the fused result against XLA's on the same inputs, writes JSON and plots the ratios.

    python -m jaxfuse.bench --suite resnet50 --batch 1 64 --dtype float16 --layout NHWC
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .cases import BenchCase
from .layers import SUITES
from .roofline import measure_ceilings
from .timing import batched, device_time_per_op, wall_time_per_op


def _progress(items: list[Any], enabled: bool) -> Any:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="benchmark", unit="case", file=sys.stderr)


def _rel_error(a: Any, b: Any) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_case(case: BenchCase, device: Any, ceilings: Any, sets: int, repeats: int,
             device_timing: bool) -> dict[str, Any]:
    plan, ops = case.plan(device)
    fused, unfused = batched(case.fused(plan, ops)), batched(case.unfused())
    args = case.arg_sets(sets, device)
    error = _rel_error(fused(args[:1])[0], unfused(args[:1])[0])
    row: dict[str, Any] = {
        "case": case.label(), "layer": case.layer.name, "n": case.n, "dtype": case.dtype,
        "layout": case.layout, "ops": case.ops,
        "solver": " ".join(str(v) for k, v in plan.kernel_info.items() if k in ("solver", "tile")),
        "rel_error_vs_xla": error,
        "fused_wall_us": wall_time_per_op(fused, args, repeats) * 1e6,
        "xla_wall_us": wall_time_per_op(unfused, args, repeats) * 1e6,
    }
    row["ratio_wall"] = row["xla_wall_us"] / row["fused_wall_us"]
    if device_timing:
        fd, xd = device_time_per_op(fused, args), device_time_per_op(unfused, args)
        if fd and xd:
            row.update(fused_device_us=fd * 1e6, xla_device_us=xd * 1e6, ratio_device=xd / fd)
    flops = case.layer.flops(case.n) if "C" in case.ops else 0
    nbytes = case.layer.min_bytes(case.n, np.dtype(case.dtype).itemsize)
    best = row.get("fused_device_us", row["fused_wall_us"]) * 1e-6
    floor = ceilings.floor(flops, nbytes, case.dtype)
    row.update(gflop=flops / 1e9, mbytes=nbytes / 1e6, tflops=flops / best / 1e12,
               gbs=nbytes / best / 1e9, floor_us=floor * 1e6, fused_over_floor=best / floor)
    return row


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    key = "ratio_device" if all("ratio_device" in r for r in rows) else "ratio_wall"
    header = (f"{'case':<44} {'solver':<26} {'fused us':>9} {'xla us':>9} {'xla/fused':>9} "
              f"{'TFLOP/s':>8} {'GB/s':>7} {'floor us':>8} {'/floor':>6} {'err':>8}")
    print(header, file=out)
    for r in rows:
        fused = r.get("fused_device_us", r["fused_wall_us"])
        xla = r.get("xla_device_us", r["xla_wall_us"])
        print(f"{r['case']:<44} {r['solver']:<26} {fused:9.1f} {xla:9.1f} {r[key]:9.2f} "
              f"{r['tflops']:8.1f} {r['gbs']:7.0f} {r['floor_us']:8.1f} "
              f"{r['fused_over_floor']:6.1f} {r['rel_error_vs_xla']:8.1e}", file=out)
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        groups.setdefault((r["n"], r["dtype"], r["layout"], r["ops"]), []).append(r[key])
    for (n, dtype, layout, ops), ratios in sorted(groups.items()):
        print(f"geomean {key} N={n} {dtype} {layout} {ops}: {_geomean(ratios):.2f} "
              f"(min {min(ratios):.2f}, {len(ratios)} cases)", file=out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "ratio_device" if all("ratio_device" in r for r in rows) else "ratio_wall"
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(rows)), 5))
    ax.bar(range(len(rows)), [r[key] for r in rows],
           color=["tab:green" if r[key] >= 1 else "tab:red" for r in rows])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["case"] for r in rows], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel(f"jax.jit / jaxfuse ({key.split('_')[1]} time)")
    ax.set_title("jaxfuse fused plan vs jax.jit of the unfused composition (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--suite", nargs="+", default=["resnet50"], choices=sorted(SUITES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--dtype", nargs="+", default=["float16"])
    parser.add_argument("--layout", nargs="+", default=["NHWC"])
    parser.add_argument("--ops", default="CBNA", help="chain for conv layers (NA layers: NA)")
    parser.add_argument("--sets", type=int, default=8, help="distinct input sets per jit")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--platform", default=None, help="cpu or gpu (default: jax's default)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    ceilings = measure_ceilings(device)
    print(f"device: {device.device_kind} ({device.platform}); copy "
          f"{ceilings.copy_bandwidth / 1e12:.2f} TB/s; matmul TFLOP/s " +
          ", ".join(f"{k} {v / 1e12:.0f}" for k, v in ceilings.matmul.items()), file=sys.stderr)
    cases = [BenchCase(layer, n, dtype, layout, args.ops if layer.has_conv else "NA")
             for suite in args.suite for layer in SUITES[suite]
             for n in args.batch for dtype in args.dtype for layout in args.layout]
    rows = []
    for case in _progress(cases, not args.no_progress):
        sets = args.sets if case.n > 1 else max(args.sets, 16)
        rows.append(run_case(case, device, ceilings, sets, args.repeats,
                             device_timing=device.platform == "gpu"))
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "device": device.device_kind,
            "jax": jax.__version__, "ceilings": dataclasses.asdict(ceilings), "rows": rows,
        }, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
