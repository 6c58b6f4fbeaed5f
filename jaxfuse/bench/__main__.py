"""``python -m jaxfuse.bench``: fused plans against ``jax.jit`` of the unfused composition.

For every case it prints per-op times (wall: K distinct inputs in one jit, median of repeats;
device: GPU kernel time from a profiler trace) of XLA's composition, of jaxfuse's kernel forced
(``solver="fused"``: what the kernels achieve) and of the plan in auto mode (what users get:
jaxfuse's own measured choice between the two), both ratios XLA / jaxfuse, the kernel's
achieved TFLOP/s, and the roofline floor from ceilings measured in the same run. On GPUs it
also gives the device span and the queued time (``jaxfuse.bench.timing``; the queued time
comes from the find step's own harness, and issue #11's per-layer bound is judged on it), and
the kernel's time as a percentage of a copy of the case's own minimal bytes ("% copy":
what a memory-bound kernel of that size can reach). It checks the results against XLA's on
the same inputs, writes JSON and plots the ratios. A plan in auto mode that compiles to XLA's
own program, or to the forced kernel's, is not timed again ("xla=" or "fused=" in the auto
column): it takes that program's time.

    python -m jaxfuse.bench --suite resnet50 --batch 1 64 --dtype float16 --layout NHWC
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..errors import FusionError
from ..measure import Timing
from . import stall
from .cases import BenchCase
from .layers import SUITES
from .roofline import measure_ceilings
from .timing import batched, device_timings, queued_times, wall_times_interleaved


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
             device_timing: bool, chained: bool = False,
             probe_stalls: bool = False) -> dict[str, Any]:
    """Times XLA's composition, jaxfuse's kernel forced (what the kernels achieve) and the plan
    in auto mode (what users get: the faster of the two, by jaxfuse's own measurement).
    `chained`: the K ops of a program depend on each other (timing.batched). `probe_stalls`
    (GPUs): trace an awaited call of a program that waits far past its device time."""
    # Each program is compiled once, ahead of time: the same executable gives the reference
    # result, the optimized text that finds twins, and every timing.
    args = case.arg_sets(sets, device)
    unfused, xla_text = compiled_program(batched(case.unfused(), chained), args)
    row: dict[str, Any] = {
        "case": case.label(), "layer": case.layer.name, "n": case.n, "dtype": case.dtype,
        "layout": case.layout, "ops": case.ops, "count": case.layer.count,
    }
    reference = unfused(args)[0]
    timed: dict[str, Any] = {"fused": None, "auto": None}
    # (one op each, for the queued measure)
    functions: dict[str, Callable[..., Any]] = {"xla": case.unfused()}
    texts: dict[str, str | None] = {"xla": xla_text}
    for mode in timed:
        try:
            plan, ops = case.plan(device, solver=mode)
        except FusionError as err:  # the forced kernel cannot be built: say so, go on
            row[f"{mode}_failed"] = str(err).splitlines()[0]
            continue
        functions[mode] = case.fused(plan, ops)
        run, texts[mode] = compiled_program(batched(functions[mode], chained), args)
        timed[mode] = run
        info = plan.kernel_info
        row[f"{mode}_solver"] = " ".join(str(info[k]) for k in ("solver", "tile") if k in info)
        for part in ("input_layout", "filters"):  # operands transposed on each call
            if part in info:
                row[f"{mode}_solver"] += f" {info[part].split()[0]}"
        if info.get("solver") == "xla":  # (its info still names the kernel it measured)
            row[f"{mode}_solver"] = "xla"
        row[f"{mode}_rel_error_vs_xla"] = _rel_error(run(args)[0], reference)
        if "compile_s" in info:  # (by step; with a cold cache, what compiling costs)
            row[f"{mode}_compile_s"] = info["compile_s"]
        if mode == "auto":
            row["auto_candidates_us"] = info.get("candidates_us", {})
            row["auto_candidates_host_us"] = info.get("candidates_host_us", {})
            row["auto_candidates_device_us"] = info.get("candidates_device_us", {})
    # The plan auto mode chose compiles to XLA's program or to the forced kernel's: timing it
    # again measures only the machine's noise (on a 2-core VM, identical programs timed up to
    # 2x apart by the wall clock; on an H200, 2026-11-28, XLA's 7.96 us batch-1 program timed
    # 12.97 us by device time), so it takes its twin's times, and the row says which.
    twin = None
    if texts.get("auto") is not None:
        first = "xla" if row.get("auto_solver") == "xla" else "fused"
        twin = next((name for name in dict.fromkeys((first, "xla", "fused"))
                     if texts.get(name) == texts["auto"]), None)
    programs = {"xla": unfused, **{m: run for m, run in timed.items()
                                   if run is not None and not (m == "auto" and twin)}}
    # (CPUs: each program's fastest run; identical programs' medians part by up to 2x there.)
    statistic = min if device.platform == "cpu" else statistics.median
    dispatch: dict[str, float] = {}
    # (warmed up here, so that the handler counters below see only the timed calls: the
    # first call records each kernel's command-buffer node)
    for _ in range(_WALL_WARMUP):
        for run in programs.values():
            jax.block_until_ready(run(args))
    stats_before = _handler_stats() if device_timing else {}
    for mode, seconds in wall_times_interleaved(programs, args, repeats, warmup=0,
                                                statistic=statistic,
                                                dispatch=dispatch).items():
        row[f"{mode}_wall_us"] = seconds * 1e6
        row[f"{mode}_dispatch_us"] = dispatch[mode] * 1e6
    kernel_programs = [mode for mode in programs
                       if mode != "xla" and row.get(f"{mode}_solver") != "xla"]
    if stats_before and kernel_programs:
        # jaxfuse's handlers' work per op of the programs that run its kernels, over the
        # timed calls: a record (creation) per op would mean XLA builds the kernel's
        # command-buffer node anew, loading its module, on every call; an update per op,
        # that the buffers moved.
        ops = len(kernel_programs) * repeats * len(args)
        row["wall_handler_per_op"] = {key: (value - stats_before.get(key, 0)) / ops
                                      for key, value in _handler_stats().items()}
    if twin is not None:
        for part in ("wall_us", "dispatch_us"):
            row[f"auto_{part}"] = row[f"{twin}_{part}"]
        row["auto_same_program_as"] = twin
    for mode in timed:
        if f"{mode}_wall_us" in row:
            row[f"ratio_{mode}_wall"] = row["xla_wall_us"] / row[f"{mode}_wall_us"]
    flops = case.layer.flops(case.n) if "C" in case.ops else 0
    nbytes = case.layer.min_bytes(case.n, np.dtype(case.dtype).itemsize)
    copy_timing = None
    if device_timing:
        # A copy of the case's own minimal bytes (half read, half written), timed as the case
        # is: the bandwidth a memory-bound kernel of this size can reach, launch and ramp
        # included, where the 1 GiB copy of the ceilings cannot be (small layers).
        copy = batched(lambda a: a * 1.5)
        key = jax.random.key(1)
        copy_sets = [(jax.device_put(jax.random.normal(jax.random.fold_in(key, i),
                                                       (max(1, nbytes // 8),)), device),)
                     for i in range(len(args))]
        traced = {"xla": (unfused, args), "copy": (copy, copy_sets),
                  **{m: (run, args) for m, run in programs.items() if m != "xla"}}
        timings = device_timings(traced)  # (one trace for all: each costs seconds)
        copy_timing, xla = timings["copy"], timings["xla"]
        row["device_trace_shared"] = bool(xla and xla.shared)
        row["xla_device_us"] = xla.seconds * 1e6 if xla else None
        row["xla_kernels_per_op"] = xla.kernels_per_op if xla else None
        row["xla_span_us"] = (xla.span or 0) * 1e6 if xla else 0
        for mode in timed:
            mine = timings.get(mode)
            if mine and xla and mine.seconds and xla.seconds:
                row[f"{mode}_device_us"] = mine.seconds * 1e6
                row[f"ratio_{mode}_device"] = xla.seconds / mine.seconds
                row[f"{mode}_kernels_per_op"] = mine.kernels_per_op
                if mine.span and row["xla_span_us"]:
                    row[f"{mode}_span_us"] = mine.span * 1e6
                    row[f"ratio_{mode}_span"] = row["xla_span_us"] / row[f"{mode}_span_us"]
        if not chained:  # (the harness runs its sets side by side)
            _add_queued(row, queued_times({m: f for m, f in functions.items()
                                           if m in programs}, args, device), twin)
        # (an auto plan with a twin was not timed: its twin's times, as for the wall clock)
        if twin and row.get(f"{twin}_device_us") and row["xla_device_us"]:
            for part in ("device_us", "kernels_per_op", "span_us"):
                if f"{twin}_{part}" in row:
                    row[f"auto_{part}"] = row[f"{twin}_{part}"]
            row["ratio_auto_device"] = row["xla_device_us"] / row["auto_device_us"]
            if row.get("auto_span_us"):
                row["ratio_auto_span"] = row["xla_span_us"] / row["auto_span_us"]
    if device_timing and probe_stalls:
        _probe_stalls(row, programs, args)
    floor = ceilings.floor(flops, nbytes, case.dtype)
    row.update(gflop=flops / 1e9, mbytes=nbytes / 1e6, floor_us=floor * 1e6)
    best = row.get("fused_device_us", row.get("fused_wall_us"))
    if best:
        row.update(tflops=flops / best / 1e6, gbs=nbytes / best / 1e3,
                   fused_over_floor=best * 1e-6 / floor)
    if device_timing and best and copy_timing and copy_timing.seconds:
        row.update(copy_device_us=copy_timing.seconds * 1e6,
                   fused_pct_of_copy=100 * copy_timing.seconds * 1e6 / best)
    return row


# Untimed calls of each program before the wall clock's rounds.
_WALL_WARMUP = 3
# An awaited call that waits this many times its device time after returning, and this
# many microseconds per op more, is traced (stall.awaited_timeline).
_STALL_FACTOR, _STALL_US = 3.0, 30.0


def _probe_stalls(row: dict[str, Any], programs: dict[str, Any], args: Any) -> None:
    """Traces one awaited call of each jaxfuse program (the forced kernel's, auto mode's
    unless a twin) whose wait past its return dwarfs its device time, and of XLA's program
    beside it, into ``row["stalls"]`` and the log. A probe that fails (a profiler already
    running, no trace written) records its error and costs the row nothing else."""
    stalled = [mode for mode in programs if mode != "xla" and f"{mode}_device_us" in row
               and row[f"{mode}_wall_us"] - row[f"{mode}_dispatch_us"]
               > _STALL_FACTOR * row[f"{mode}_device_us"] + _STALL_US]
    if not stalled:
        return
    row["stalls"] = {}
    for mode in ["xla", *stalled]:
        try:
            timeline = stall.awaited_timeline(programs[mode], args)
        except Exception as err:  # a diagnostic: never the sweep's end
            row["stalls"][mode] = {"error": f"{type(err).__name__}: {err}"}
            continue
        row["stalls"][mode] = timeline
        print(f"stall probe, {row['case']}, {mode} ({len(args)} ops a call): wall "
              f"{row[f'{mode}_wall_us']:.1f} dispatch {row[f'{mode}_dispatch_us']:.1f} us/op\n"
              f"{stall.describe(timeline)}", flush=True)
    # A control: XLA's own program that dispatches as fast and barely uses the device. Its
    # wait past its return is the host learning of a completion, whoever's program it is.
    try:
        row["stalls"]["control"] = {
            "runs_us": stall.awaited_runs(stall.control_program(), args)}
    except Exception as err:  # (as above)
        row["stalls"]["control"] = {"error": f"{type(err).__name__}: {err}"}
        return
    print(f"  control (XLA, one tiny kernel a call): {row['stalls']['control']['runs_us']}",
          flush=True)


def _handler_stats() -> dict[str, float]:
    """The GPU backend's counters (records, updates, loads...; empty without the extension's
    GPU support)."""
    from .._extension import extension

    try:
        return dict(extension().gpu_stats())
    except Exception:
        return {}


def _add_queued(row: dict[str, Any], queued: dict[str, Timing | None],
                twin: str | None) -> None:
    """The queued measure's times and ratios into `row` (an auto plan with a twin takes the
    twin's)."""
    queued = dict(queued)
    if twin is not None and queued.get(twin) is not None:
        queued["auto"] = queued[twin]
    xla = queued.get("xla")
    for mode, timing in queued.items():
        if timing is None or xla is None or not timing.device:
            continue
        row[f"{mode}_queued_us"] = timing.device * 1e6
        row[f"{mode}_queued_host_us"] = timing.host * 1e6
        if mode != "xla":
            row[f"ratio_{mode}_queued"] = xla.device / timing.device


def compiled_program(fn: Any, args: Any) -> tuple[Any, str | None]:
    """Jitted `fn` compiled for `args`, and its optimized program's text
    (:func:`program_text`); `fn` itself and None where it does not compile ahead of time
    here."""
    try:
        compiled = fn.lower(args).compile()
    except Exception:  # a program that does not lower here is simply not compared
        return fn, None
    return compiled, _comparable_text(compiled.as_text())


def program_text(fn: Any, args: Any) -> str | None:
    """The optimized program jitted `fn` compiles to for `args`, with names, metadata, source
    locations and the module's name left out (None where it does not compile here)."""
    return compiled_program(fn, args)[1]


def _comparable_text(text: str) -> str:
    lines = text.splitlines()
    # (the source-location tables name the Python functions that built each program)
    compiled = "\n".join(line for line in lines if not re.match(
        r"\s*(\d+ [\"{]|FileNames|FunctionNames|FileLocations|StackFrames)", line))
    compiled = re.sub(r", metadata=\{[^}]*\}", "", compiled)
    compiled = re.sub(r"HloModule \S+", "HloModule", compiled)
    return re.sub(r"[%\w.-]*\.\d+\b|%[\w.-]+", "_", compiled)


def same_program(a: Any, b: Any, args: Any) -> bool:
    """Whether jitted `a` and `b` compile to the same optimized program for `args`."""
    text = program_text(a, args)
    return text is not None and text == program_text(b, args)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _kind(rows: list[dict[str, Any]]) -> str:
    """"device" when every row has device times, else "wall"."""
    return "device" if all("ratio_auto_device" in r for r in rows) else "wall"


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    kind = _kind(rows)
    header = (f"{'case':<46} {'fused kernel':<26} {'fused us':>9} {'xla us':>9} "
              f"{'xla k':>5} {'forced x':>8} {'auto x':>7} {'auto':<6} {'span x':>6} "
              f"{'queued x':>8} "
              f"{'TFLOP/s':>8} {'floor us':>8} {'err':>8} {'% copy':>6}")
    print(header, file=out)
    nan = float("nan")
    for r in rows:
        fused = r.get(f"fused_{kind}_us", nan)
        xla = r.get(f"xla_{kind}_us", nan) or nan
        auto = "xla" if r.get("auto_solver", "").startswith("xla") else "fused"
        if r.get("auto_same_program_as"):
            auto += "="  # the same compiled program as XLA's or the forced kernel's: its time
        print(f"{r['case']:<46} {r.get('fused_solver', 'FAILED'):<26} {fused:9.1f} {xla:9.1f} "
              f"{r.get('xla_kernels_per_op') or nan:5.1f} "
              f"{r.get(f'ratio_fused_{kind}', nan):8.2f} {r.get(f'ratio_auto_{kind}', nan):7.2f} "
              f"{auto:<6} {r.get('ratio_auto_span', nan):6.2f} "
              f"{r.get('ratio_auto_queued', nan):8.2f} "
              f"{r.get('tflops', nan):8.1f} {r['floor_us']:8.1f} "
              f"{r.get('fused_rel_error_vs_xla', nan):8.1e} "
              f"{r.get('fused_pct_of_copy', nan):6.0f}", file=out)
    # (device time: the span and the queued time too, gaps between kernels included)
    measures = [kind, "span", "queued"] if kind == "device" else [kind]
    for measure in measures:
        groups: dict[tuple[Any, ...], dict[str, list[float]]] = {}
        for r in rows:  # (by suite where the rows name theirs: one run may hold several)
            group = groups.setdefault((r.get("suite") or "", r["n"], r["dtype"], r["layout"],
                                       r["ops"]), {"fused": [], "auto": []})
            for mode in group:
                if f"ratio_{mode}_{measure}" in r:
                    group[mode].append(r[f"ratio_{mode}_{measure}"])
        for (suite, n, dtype, layout, ops), ratios in sorted(groups.items()):
            forced, auto = ratios["fused"], ratios["auto"]
            if not (auto or forced):
                continue
            print(f"geomean xla/jaxfuse ({measure}) {suite + ' ' if suite else ''}"
                  f"N={n} {dtype} {layout} {ops}: forced "
                  f"{_geomean(forced):.2f} (min {min(forced, default=nan):.2f}), auto "
                  f"{_geomean(auto):.2f} (min {min(auto, default=nan):.2f}), {len(auto)} cases",
                  file=out)
    # A network suite (layers with counts): the summed time of all its convolutions.
    for (suite, n, dtype, layout), members in _network_groups(rows).items():
        sums = {mode: sum(r["count"] * r.get(f"{mode}_{kind}_us", nan) for r in members)
                for mode in ("xla", "fused", "auto")}
        print(f"network sum ({kind}) {suite + ' ' if suite else ''}N={n} {dtype} {layout}: "
              f"xla {sums['xla']:.0f} us, forced "
              f"{sums['fused']:.0f} us ({sums['xla'] / sums['fused']:.2f}x), auto "
              f"{sums['auto']:.0f} us ({sums['xla'] / sums['auto']:.2f}x), "
              f"{sum(r['count'] for r in members)} convolutions", file=out)


def _network_groups(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Rows of network suites (those with a count above 1 somewhere), by suite (where the
    rows name theirs), batch, dtype and layout."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("suite") or "", r["n"], r["dtype"], r["layout"]), []).append(r)
    return {k: v for k, v in groups.items() if any(r.get("count", 1) > 1 for r in v)}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = _kind(rows)
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(rows)), 5))
    at = np.arange(len(rows))
    bars = ((-0.2, "fused", "tab:blue", "jaxfuse kernel forced"),
            (0.2, "auto", "tab:green", "auto (what users get)"))
    for offset, mode, color, label in bars:
        ax.bar(at + offset, [r.get(f"ratio_{mode}_{kind}", 0) for r in rows], width=0.4,
               color=color, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(at)
    ax.set_xticklabels([r["case"] for r in rows], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel(f"jax.jit / jaxfuse ({kind} time)")
    ax.set_title("jaxfuse vs jax.jit of the unfused composition (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--suite", nargs="+", default=["resnet50"], choices=sorted(SUITES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--dtype", nargs="+", default=["float16"])
    parser.add_argument("--layout", nargs="+", default=["NHWC"])
    parser.add_argument("--filter-layout", nargs="+", default=[None],
                        choices=["HWIO", "OHWI", "OIHW"],
                        help="filter layouts (default: HWIO for NHWC, OIHW for NCHW)")
    parser.add_argument("--filter-dtype", default=None, choices=["float32"],
                        help="keep the filters in float32 (converted for the convolution, as "
                        "a Flax model's parameters are); default: the data dtype")
    parser.add_argument("--ops", default="CBNA", help="chain for conv layers (NA layers: NA; "
                        "layers without an activation drop the A)")
    parser.add_argument("--sets", type=int, default=8, help="distinct input sets per jit")
    parser.add_argument("--chain", action="store_true",
                        help="each op of a jit waits for the previous one's result, as a "
                        "network's layers do (no merging of independent ops into one kernel)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--platform", default=None, help="cpu or gpu (default: jax's default)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--layers", default=None, metavar="REGEX",
                        help="only the suites' layers whose names match (re.search)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--probe-stalls", action="store_true",
                        default=os.environ.get("JAXFUSE_BENCH_PROBE_STALLS") == "1",
                        help="GPUs: trace one awaited call of each program whose wall time "
                             "waits far past its device time (also JAXFUSE_BENCH_PROBE_STALLS=1)")
    args = parser.parse_args(argv)

    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    ceilings = measure_ceilings(device)
    print(f"device: {device.device_kind} ({device.platform}); copy "
          f"{ceilings.copy_bandwidth / 1e12:.2f} TB/s; matmul TFLOP/s " +
          ", ".join(f"{k} {v / 1e12:.0f}" for k, v in ceilings.matmul.items()), file=sys.stderr)
    cases = [(suite, BenchCase.for_layer(layer, n, dtype, layout, args.ops, filters,
                                         args.filter_dtype))
             for suite in args.suite for layer in SUITES[suite]
             if args.layers is None or re.search(args.layers, layer.name)
             for n in args.batch for dtype in args.dtype for layout in args.layout
             for filters in args.filter_layout]
    rows = []
    for suite, case in _progress(cases, not args.no_progress):
        sets = args.sets if case.n > 1 else max(args.sets, 16)
        rows.append({"suite": suite, **run_case(
            case, device, ceilings, sets, args.repeats,
            device_timing=device.platform == "gpu", chained=args.chain,
            probe_stalls=args.probe_stalls)})
        if args.no_progress:  # a log of rows as they finish, should the run be cut short
            print(json.dumps(rows[-1], default=str), file=sys.stderr)
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
