"""Merge several ``python -m jaxfuse.bench --json`` runs into one markdown table.

Per case: median fused and XLA wall times over the runs, the median ratio XLA / fused and its
spread (min-max over runs), and, given ``--before`` runs of an older build, their median ratio.

    python scripts/bench_aggregate.py --runs new_*.json --before base_*.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(paths: list[Path]) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    order: list[str] = []
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if row["case"] not in rows:
                order.append(row["case"])
            rows[row["case"]].append(row)
    return rows, order


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path, required=True)
    parser.add_argument("--before", nargs="*", type=Path, default=[])
    args = parser.parse_args()
    runs, order = load(args.runs)
    before, _ = load(args.before)
    median = statistics.median
    head = "| layer | N | dtype | layout | fused ms | xla ms | xla/fused | spread |"
    rule = "|---|---:|---|---|---:|---:|---:|---|"
    if before:
        head += " before |"
        rule += "---:|"
    print(head)
    print(rule)
    groups: dict[tuple[Any, ...], list[tuple[float, float | None]]] = defaultdict(list)
    for case in order:
        rows = runs[case]
        ratios = [r["ratio_wall"] for r in rows]
        first = rows[0]
        line = (f"| {first['layer']} | {first['n']} | {first['dtype']} | {first['layout']} | "
                f"{median(r['fused_wall_us'] for r in rows) / 1e3:.3f} | "
                f"{median(r['xla_wall_us'] for r in rows) / 1e3:.3f} | **{median(ratios):.2f}** | "
                f"{min(ratios):.2f}-{max(ratios):.2f} |")
        old = median(r["ratio_wall"] for r in before[case]) if case in before else None
        if before:
            line += f" {old:.2f} |" if old else " |"
        print(line)
        kind = "NA" if first["ops"] == "NA" else "conv"
        groups[(first["n"], first["dtype"], first["layout"], kind)].append((median(ratios), old))
    print()
    for (n, dtype, layout, kind), values in sorted(groups.items()):
        text = (f"- N={n} {dtype} {layout} {kind}: geomean {geomean([v for v, _ in values]):.2f} "
                f"(min {min(v for v, _ in values):.2f}, {len(values)} cases)")
        olds = [o for _, o in values if o]
        if before and len(olds) == len(values):
            text += f"; before {geomean(olds):.2f}"
        print(text)


if __name__ == "__main__":
    main()
