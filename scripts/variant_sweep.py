"""Kernel-variant sweep on a GPU: each variant a solver offers forced, the one autotuning
picks, and XLA's composition, on a suite's layers: by default the MobileNet suites' depthwise
layers (`--kind all`: every layer, e.g. the pointwise NA suite).

    python scripts/variant_sweep.py --batch 64 --dtype bfloat16 [--json out.json]
    python scripts/variant_sweep.py --suite na --kind all --batch 1 --variants 8
    python scripts/variant_sweep.py --layout NCHW --dtype float16 --variants 4  # conv_planes

Every variant runs in its own child process (JAXFUSE_KERNEL_VARIANT is read once a process);
indices past a plan's last variant repeat it and are printed once. Per layer it prints device
time (profiler, K distinct input sets in one jit, as `python -m jaxfuse.bench` measures),
achieved GB/s on the minimal bytes (input, filters and output once) and their fraction of the
copy bandwidth measured in the same run (issue #14's depthwise target: >= 80% at batch 64),
XLA's device time, and the relative error against XLA's result on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

VARIANTS = 8  # depthwise: 4 tilings, 2 walking, a cp.async twin (sm_90), the vector kernel


def _cases(suites: list[str], batches: list[int], dtypes: list[str], only: str,
           kind: str = "depthwise", layout: str = "NHWC") -> list[Any]:
    from jaxfuse.bench.cases import BenchCase
    from jaxfuse.bench.layers import SUITES

    seen, cases = set(), []
    for suite in suites:
        for layer in SUITES[suite]:
            if (kind == "depthwise" and layer.groups <= 1) or not re.search(only, layer.name):
                continue
            for n in batches:
                for dtype in dtypes:
                    case = BenchCase.for_layer(layer, n, dtype, layout, "CBNA")
                    if case.label() not in seen:
                        seen.add(case.label())
                        cases.append(case)
    return cases


def child(args: argparse.Namespace) -> None:
    """Times every case with the variant this process was started with; JSON lines out."""
    import jax
    import numpy as np

    from jaxfuse.bench.timing import batched, device_time_per_op, wall_time_per_op

    def seconds(run: Any, sets: list[Any]) -> float:  # wall time where there is no profiler
        return device_time_per_op(run, sets) or wall_time_per_op(run, sets, repeats=3)

    device = jax.devices(args.platform)[0]
    for case in _cases(args.suite, args.batch, args.dtype, args.only, args.kind, args.layout):
        row: dict[str, Any] = {"case": case.label(), "variant": args.child}
        try:
            plan, ops = case.plan(device, solver="fused")
            info = plan.kernel_info
            row.update(solver=info.get("solver"), tile=info.get("tile"),
                       chosen=info.get("variant"))
            sets = case.arg_sets(args.sets if case.n > 1 else max(args.sets, 16), device)
            fused, unfused = batched(case.fused(plan, ops)), batched(case.unfused())
            out = np.asarray(fused(sets[:1])[0], np.float64)
            ref = np.asarray(unfused(sets[:1])[0], np.float64)
            row["rel_error_vs_xla"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            row["us"] = seconds(fused, sets) * 1e6
            if args.child == "tuned":
                row["xla_us"] = seconds(unfused, sets) * 1e6
        except Exception as err:  # report it, go on with the next case
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)


def _child_rows(command: list[str], env: dict[str, str], timeout: float,
                name: str) -> Iterator[dict[str, Any]]:
    """The JSON rows a child prints, each as it is printed; the child is ended after `timeout`
    seconds, and its error output shown when it fails."""
    with tempfile.TemporaryFile("w+") as errors:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=errors,
                                 text=True)
        timer = threading.Timer(timeout, child.kill)
        timer.start()
        try:
            for line in child.stdout:
                if line.startswith("{"):
                    yield json.loads(line)
        finally:
            try:
                code = child.wait(timeout=30)  # (its output ended: it is exiting)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
            timer.cancel()
        if code != 0:
            errors.seek(0)
            print(f"{name}: exit {code}\n{errors.read()[-2000:]}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", nargs="+", default=["mobilenet", "mobilenetv2"])
    parser.add_argument("--batch", nargs="+", type=int, default=[64])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--only", default="",
                        help="a regular expression on layer names (e.g. 'dw_7|dw_14')")
    parser.add_argument("--kind", default="depthwise", choices=["depthwise", "all"],
                        help="the suites' depthwise layers, or all of them")
    parser.add_argument("--layout", default="NHWC", choices=["NHWC", "NCHW"])
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--variants", type=int, default=VARIANTS)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per child")
    parser.add_argument("--json", default=None)
    parser.add_argument("--platform", default="gpu", help="cpu: a smoke test of the script")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return 0

    import jax
    import numpy as np

    from jaxfuse.bench.roofline import measure_ceilings

    copy = measure_ceilings(jax.devices(args.platform)[0], matmul_size=256).copy_bandwidth
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s", file=sys.stderr)
    cases = {c.label(): c for c in _cases(args.suite, args.batch, args.dtype, args.only,
                                          args.kind, args.layout)}
    # Rows are printed (and the JSON rewritten) as each case ends, so that a sweep cut short by
    # a time cap keeps what it measured: the autotuned choice first, then each distinct variant.
    print(f"{'case':<44} {'variant':>7} {'tile':<18} {'us':>8} {'xla us':>8} {'GB/s':>7} "
          f"{'% copy':>6} {'err':>8}", flush=True)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, Any, Any]] = set()
    cache = tempfile.mkdtemp(prefix="jaxfuse-sweep-")  # tuned choices made fresh in this run
    for variant in ["tuned", *map(str, range(args.variants))]:
        env = {**os.environ, "JAXFUSE_CACHE_DIR": cache, "JAXFUSE_SOLVER": "fused"}
        env.pop("JAXFUSE_KERNEL_VARIANT", None)
        if variant != "tuned":
            env["JAXFUSE_KERNEL_VARIANT"] = variant
        command = [sys.executable, "-P", os.path.abspath(__file__), "--child", variant,
                   "--suite", *args.suite, "--batch", *map(str, args.batch),
                   "--dtype", *args.dtype, "--only", args.only, "--kind", args.kind,
                   "--layout", args.layout, "--sets", str(args.sets),
                   "--platform", args.platform]
        for r in _child_rows(command, env, args.timeout, f"variant {variant}"):
            rows.append(r)
            case = cases.get(r["case"])
            if case is None:
                continue
            if "error" in r:
                print(f"{r['case']:<44} {r['variant']:>7} ERROR {r['error']}", flush=True)
                continue
            if r["variant"] != "tuned":
                if (r["case"], r["solver"], r["tile"]) in seen:
                    continue  # a clamped index repeats the last variant
                seen.add((r["case"], r["solver"], r["tile"]))
            nbytes = case.layer.min_bytes(case.n, np.dtype(case.dtype).itemsize)
            gbs = nbytes / (r["us"] * 1e-6) / 1e9
            r.update(gbs=gbs, copy_fraction=gbs * 1e9 / copy)
            xla = r.get("xla_us", float("nan"))
            print(f"{r['case']:<44} {r['variant']:>7} {r['tile']!s:<18} {r['us']:8.1f} "
                  f"{xla:8.1f} {gbs:7.0f} {100 * gbs * 1e9 / copy:6.1f} "
                  f"{r['rel_error_vs_xla']:8.1e}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"copy_bandwidth": copy, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
