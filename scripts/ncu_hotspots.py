"""The instructions where a profiled kernel's warps wait, from Nsight Compute's source page.

    ncu --section SourceCounters -o report python scripts/ncu_layer.py ...
    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/ncu_hotspots.py sass.csv [--top 25]

Prints the samples of the kernel's phases (setup before its first copy, the copies' issue, the
main loop from its first to its last tensor-core multiply, the epilogue after it) with their
main stall reasons, then the SASS lines with the most warp-stall samples (PC sampling), each
with its share of all samples and the reasons ncu attributes to it, so a kernel's time can be
pinned to its instructions (the barrier wait, a load's first use, the epilogue) instead of
guessed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import sys
from pathlib import Path


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _phases(sass: list[str]) -> list[tuple[str, int, int]]:
    """(name, first line, end) of setup, copy issue, main loop and epilogue: split at the first
    copy (cp.async or bulk tensor copy) and the first and last tensor-core multiply."""
    def first(keys: tuple[str, ...], lines: range) -> int | None:
        return next((i for i in lines if any(k in sass[i] for k in keys)), None)
    copy = first(("LDGSTS", "UTMALDG", "UBLKCP"), range(len(sass)))
    mma = first(("HGMMA", "HMMA"), range(len(sass)))
    last = first(("HGMMA", "HMMA"), range(len(sass) - 1, -1, -1))
    if copy is None or mma is None or last is None or not copy <= mma <= last:
        return [("all", 0, len(sass))]
    return [("setup", 0, copy), ("copies", copy, mma), ("main loop", mma, last + 1),
            ("epilogue", last + 1, len(sass))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv_file")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    text = Path(args.csv_file).read_text(encoding="utf-8", errors="replace")
    # ncu prints a line of its own before the table in some versions: start at the header.
    start = text.find('"Address"')
    if start < 0:
        start = text.find('"# Address"')
    if start < 0:
        print("no source table in", args.csv_file, file=sys.stderr)
        print(text[:2000], file=sys.stderr)
        return 1
    # One kernel's table: a report of several repeats the header for each.
    header_end = text.find("\n", start)
    again = text.find(text[start:header_end], header_end)
    rows = list(csv.DictReader(io.StringIO(text[start:again if again > 0 else len(text)])))
    if not rows:
        return 1
    columns = list(rows[0])
    samples = next((c for c in columns if c.startswith("Warp Stall Sampling (All")), None)
    if samples is None:
        print("columns:", columns, file=sys.stderr)
        return 1
    source = next((c for c in columns if c == "Source"), None)
    if source is None:
        print("columns:", columns, file=sys.stderr)
        return 1
    address = columns[0]
    reasons = [c for c in columns if c.startswith("stall_") or c.startswith("smsp__pcsamp")]
    total = sum(_number(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples, {len(reasons)} reason columns")
    for name, lo, hi in _phases([r[source].strip() for r in rows]):
        counts: collections.Counter[str] = collections.Counter()
        for r in rows[lo:hi]:
            for c in reasons:
                if "Not Issued" not in c:
                    counts[c.replace("stall_", "")] += _number(r[c])
        part = sum(_number(r[samples]) for r in rows[lo:hi]) / total
        top = ", ".join(f"{k} {v:.0f}" for k, v in counts.most_common(4) if v > 0)
        print(f"{name:<10} lines {lo:5d}-{hi:5d} {part:6.1%}  {top}")
    ranked = sorted(range(len(rows)), key=lambda i: _number(rows[i][samples]), reverse=True)
    for i in ranked[:args.top]:
        r = rows[i]
        share = _number(r[samples]) / total
        why = sorted(((_number(r[c]), c) for c in reasons), reverse=True)[:3]
        why_text = ", ".join(f"{c.replace('smsp__pcsamp_warps_issue_stalled_', '')} {v:.0f}"
                             for v, c in why if v > 0)
        print(f"{share:6.1%} line {i:5d} {r[address]:>8} {r[source].strip()[:60]:<60} {why_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
