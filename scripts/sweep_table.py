"""Summarize a GPU sweep's layer rows (``python -m jaxfuse.bench --json`` files) as markdown.

One line per (suite, dtype, layout, run variant): the cases at each batch and the geomean
(min) of the forced and auto ratios by one measure (device by default), then every case below
a bound, then the plans' compile times where the rows have them (every case above 2 s). A run
variant is a queue item's own variables or layers (the files' ``_e``/``_m`` tags,
scripts/gpu_parallel.sh), so a suite run with and without a variable is not mixed.

    python scripts/sweep_table.py benchmarks/results/s24_call*/gpu*/gpu*/layers_*.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def geomean_min(values: list[float]) -> str:
    """"geomean (min)" of `values`, "-" without any."""
    if not values:
        return "-"
    mean = math.exp(sum(math.log(v) for v in values) / len(values))
    return f"{mean:.2f} ({min(values):.2f})"


def load(paths: list[Path]) -> list[dict[str, Any]]:
    """Every row of `paths`, each with its file's run variant ("" for a plain item's)."""
    rows = []
    for path in paths:
        variant = "".join(re.findall(r"_([em][0-9a-f]{6})", path.stem))
        rows += [{**row, "variant": variant} for row in json.loads(path.read_text())["rows"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--measure", default="device",
                        choices=["device", "span", "queued", "wall"])
    parser.add_argument("--bound", type=float, default=0.97)
    parser.add_argument("--compile-bound", type=float, default=2.0,
                        help="seconds a plan's selection may take (issue #11: 2, cold)")
    args = parser.parse_args()
    rows = load(args.files)
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row.get("suite", "?"), row["dtype"], row["layout"], row["variant"])].append(row)
    batches = sorted({row["n"] for row in rows})
    print(f"{len(rows)} cases; XLA / jaxfuse by {args.measure} time, batch "
          + " / ".join(map(str, batches)) + "\n")
    print("| suite | dtype | layout | cases | forced geomean (min) | auto geomean (min) |")
    print("|---|---|---|---|---|---|")
    for (suite, dtype, layout, variant), members in sorted(groups.items()):
        if variant:
            layout += f" ({variant})"
        counts, forced, auto = [], [], []
        for n in batches:
            at_n = [r for r in members if r["n"] == n]
            counts.append(str(len(at_n)))
            for mode, out in (("fused", forced), ("auto", auto)):
                out.append(geomean_min([r[f"ratio_{mode}_{args.measure}"] for r in at_n
                                        if r.get(f"ratio_{mode}_{args.measure}")]))
        print(f"| {suite} | {_SHORT.get(dtype, dtype)} | {layout} | {' / '.join(counts)} | "
              f"{' / '.join(forced)} | {' / '.join(auto)} |")
    below = [r for r in rows
             if (r.get(f"ratio_auto_{args.measure}") or math.inf) < args.bound]
    missing = [r for r in rows if not r.get(f"ratio_auto_{args.measure}")]
    print(f"\n{len(below)} below {args.bound} by {args.measure} time; "
          f"{len(missing)} without that measure")
    for r in sorted(below, key=lambda r: r[f"ratio_auto_{args.measure}"]):
        others = " ".join(f"{m} {r[f'ratio_auto_{m}']:.2f}"
                          for m in ("device", "span", "queued", "wall")
                          if m != args.measure and r.get(f"ratio_auto_{m}"))
        tag = f" [{r['variant']}]" if r["variant"] else ""
        print(f"- {r['case']}{tag} ({r['auto_solver']}): {r[f'ratio_auto_{args.measure}']:.3f}; "
              f"{others}; find step xla / fused "
              + " / ".join(f"{r.get('auto_candidates_device_us', {}).get(k, math.nan):.1f}"
                           for k in ("xla", "fused")) + " us")

    print_compile_costs(rows, args.compile_bound)


def compile_seconds(row: dict[str, Any]) -> tuple[float, float] | None:
    """What compiling `row`'s plan cost: (kernel, selection). The kernel step compiles and
    tunes every form of the fused kernel (or finds them in the caches); the selection, which
    issue #11 bounds, times the forms against each other (the forced plan's "forms") and the
    fused kernel against XLA's composition (the auto plan's "choice", and its kernel step's
    wait for XLA's candidate compiled beside it, "waited"). None where the row does not
    say. (Rows written before "forms" was its own step count it in the kernel step; a
    plan the process had compiled before reports that first compile's seconds.)"""
    if "auto_compile_s" not in row:
        return None
    fused = row.get("fused_compile_s", row["auto_compile_s"])
    return (fused.get("kernel", 0.0),
            fused.get("forms", 0.0) + row["auto_compile_s"].get("choice", 0.0) +
            row["auto_compile_s"].get("waited", 0.0))


def print_compile_costs(rows: list[dict[str, Any]], bound: float) -> None:
    """The plans' compile times (cold where the run began with an empty cache) and every case
    whose selection took above `bound` seconds."""
    costs = [(c, r["case"]) for r in rows if (c := compile_seconds(r)) is not None]
    if not costs:
        return
    kernel = sorted(k for (k, _), _ in costs)
    selection = sorted(((s, case) for (_, s), case in costs), reverse=True)
    print(f"\nplan compile: kernel step median {kernel[len(kernel) // 2]:.2f} s, max "
          f"{kernel[-1]:.2f} s; selection (forms + choice) median "
          f"{selection[len(selection) // 2][0]:.2f} s, max {selection[0][0]:.2f} s "
          f"({selection[0][1]}), {sum(s > bound for s, _ in selection)} of {len(selection)} "
          f"above {bound} s")
    for seconds, case in selection:
        if seconds <= bound:
            break
        print(f"- {case}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
