"""``python -m jaxfuse.bench.end_to_end``: a whole Flax network's inference forward pass, jitted,
with every conv chain fused by :func:`jaxfuse.fuse`, against the same model under plain
``jax.jit`` — per batch size and dtype, in the same run.

Time per forward: wall time of several calls issued back to back (dispatch overlaps the device
work, as in a serving loop), median of repeats, the programs timed in turns; on GPUs also the
kernels' device time from a profiler trace. The fused program runs in each solver mode asked
for: ``auto`` (what users get: per chain, the faster of jaxfuse's kernel and XLA's by jaxfuse's
own measurement) and ``fused`` (jaxfuse's kernels forced: what they achieve). The outputs are
compared too.

    python -m jaxfuse.bench.end_to_end --model resnet50 --batch 1 8 64 --dtype float16
    python -m jaxfuse.bench.end_to_end --batch 128 512 --devices 1 2   # data-parallel scaling
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import fuse, fusion_report
from .independent import EfficientNetB0, MobileNetV2, ResNet50
from .models import mobilenet, random_variables, resnet50
from .timing import device_timings

MODELS = {"resnet50": resnet50, "mobilenet": mobilenet,
          "resnet50-independent": ResNet50, "mobilenetv2-independent": MobileNetV2,
          "efficientnetb0-independent": EfficientNetB0}


def back_to_back(fn: Any, args: tuple[Any, ...], calls: int, keep_outputs: bool = True) -> Any:
    """Queues `calls` calls of `fn` back to back: every output kept (returned as a list), or
    each dropped once the next call is queued (the last returned)."""
    if keep_outputs:
        return [fn(*args) for _ in range(calls)]
    for _ in range(calls):
        out = fn(*args)
    return out


def forward_seconds(fn: Any, args: tuple[Any, ...], calls: int = 10, repeats: int = 7,
                    keep_outputs: bool = True) -> float:
    """Median over repeats of (time of up to `calls` back-to-back calls) / calls; slow programs
    get fewer calls per repeat (about 50 ms each). With `keep_outputs` off each call's output
    is dropped once the next call is queued (a server handing each result on) instead of all
    being kept: XLA's buffers then stay where they were, and its command buffers need no
    update."""
    return forward_seconds_interleaved({"": fn}, args, calls, repeats, keep_outputs)[""]


def forward_seconds_interleaved(programs: dict[str, Any], args: tuple[Any, ...],
                                calls: int = 10, repeats: int = 15,
                                keep_outputs: bool = True) -> dict[str, float]:
    """`forward_seconds` of each of `programs` on the same `args`, timed in turns: one block
    of calls of each per round, the order rotating from round to round, so that the host's
    state (clocks, another process, the allocator) drifts over all of them alike. Timed one
    after another, two programs of the same kernels and device time came out 0.43 and 0.81 ms
    per forward at batch 8 (MobileNetV2, H100, 2026-11-27), the faster one flipping between
    runs."""
    longest = 1e-6
    for fn in programs.values():
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        longest = max(longest, time.perf_counter() - start)
    calls = int(min(calls, max(1, 0.05 // longest)))  # (blocks of about 50 ms at most)
    times: dict[str, list[float]] = {name: [] for name in programs}
    names = list(programs)
    for round_ in range(repeats):
        for i in range(len(names)):
            name = names[(round_ + i) % len(names)]
            start = time.perf_counter()
            jax.block_until_ready(back_to_back(programs[name], args, calls, keep_outputs))
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


# Cross-device operations in an optimized HLO module.
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def place(x: Any, variables: Any, devices: list[Any]) -> tuple[Any, Any]:
    """`x` and `variables` on one device, or data-parallel over several: the batch sharded
    over a one-axis mesh, the variables replicated."""
    if len(devices) == 1:
        return jax.device_put(x, devices[0]), jax.device_put(variables, devices[0])
    mesh = Mesh(np.asarray(devices), ("data",))
    return (jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))),
            jax.device_put(variables, NamedSharding(mesh, PartitionSpec())))


def collectives(program: Any, *args: Any) -> int:
    """How many cross-device operations the compiled `program` runs (0 when every device
    works on its own shard)."""
    text = program.lower(*args).compile().as_text()
    return sum(text.count(f" {name}(") + text.count(f" {name}-start(") for name in COLLECTIVES)


def model_inputs(model_name: str, dtype: str, batch: int,
                 size: int = 224) -> tuple[Any, Any, np.ndarray]:
    """A model of :data:`MODELS`, its random variables and a random NHWC input batch (host
    arrays: place them where they should run)."""
    model = MODELS[model_name](dtype=jnp.dtype(dtype))
    x = np.random.default_rng(0).standard_normal((batch, size, size, 3)).astype(dtype)
    return model, random_variables(model, jnp.asarray(x[:1])), x


def run(model_name: str, batch: int, dtype: str, size: int, device: Any,
        modes: tuple[str, ...] = ("auto", "fused"), devices: int = 1) -> dict[str, Any]:
    """One model, batch and dtype: plain ``jax.jit`` against ``jax.jit(fuse(apply))`` in each
    solver mode of `modes` ("auto": what users get; "fused": jaxfuse's kernels forced). With
    `devices` > 1 the batch is sharded over that many devices of `device`'s platform."""
    model, variables, x = model_inputs(model_name, dtype, batch, size)
    placed = jax.devices(device.platform)[:devices] if devices > 1 else [device]
    if len(placed) < devices:
        raise ValueError(f"--devices {devices}: only {len(placed)} {device.platform} devices")
    x, variables = place(x, variables, placed)
    plain = jax.jit(model.apply)
    start = time.perf_counter()
    y_plain = np.asarray(plain(variables, x), np.float64)
    row: dict[str, Any] = {"model": model_name, "batch": batch, "dtype": dtype, "image": size,
                           "devices": devices, "plain_first_call_s": time.perf_counter() - start}
    programs = {"plain": plain}
    for mode in modes:
        try:
            start = time.perf_counter()  # compiles every plan: NVRTC, autotuning, choice
            report = fusion_report(fuse(model.apply, solver=mode), variables, x)
            row[f"{mode}_plans_s"] = time.perf_counter() - start
            fused = jax.jit(fuse(model.apply, solver=mode))
            start = time.perf_counter()
            y = np.asarray(fused(variables, x), np.float64)  # traces, compiles every plan
            row[f"{mode}_first_call_s"] = time.perf_counter() - start
        except Exception as err:
            row[f"{mode}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            continue
        programs[mode] = fused
        if mode == "auto":  # which chains run fused, which XLA's, and the measured times
            print(f"{model_name} N={batch} {dtype}:\n{report.summary()}\n"
                  f"{_slowest_plans(report)}", file=sys.stderr)
        row.update({
            f"{mode}_fused_groups": len(report.fused), f"{mode}_to_xla": len(report.to_xla),
            f"{mode}_left_alone": len(report.left_alone),
            f"{mode}_rel_diff_vs_plain": float(np.linalg.norm(y - y_plain) /
                                               np.linalg.norm(y_plain)),
        })
        if devices > 1:
            row[f"{mode}_collectives"] = collectives(fused, variables, x)
    start = time.perf_counter()
    for name, seconds in forward_seconds_interleaved(programs, (variables, x)).items():
        row[f"{name}_ms"] = seconds * 1e3
    row["timing_s"] = time.perf_counter() - start
    for mode in programs.keys() - {"plain"}:
        row[f"{mode}_speedup"] = row["plain_ms"] / row[f"{mode}_ms"]
    if device.platform == "gpu" and devices == 1:  # the trace's kernels are one device's
        sets = [(variables, x)]
        # (one trace for all programs where their calls can be told apart: each costs seconds)
        timings = device_timings({name: (jax.jit(lambda s, p=program: [p(*a) for a in s]), sets)
                                  for name, program in programs.items()})
        kernels = {name: t.by_kernel for name, t in timings.items() if t is not None}
        for name, timing in timings.items():
            if timing is not None and timing.seconds:
                row[f"{name}_device_ms"] = timing.seconds * 1e3
        if "auto" in kernels and "plain" in kernels:
            print(_kernel_diff(kernels["plain"], kernels["auto"]), file=sys.stderr)
    return row


def _slowest_plans(report: Any, top: int = 5) -> str:
    """The distinct plans that took longest to compile (kernel, the kernel's wait for XLA's
    candidate compiled beside it, forms, choice), one line each."""
    steps = ("kernel", "waited", "forms", "choice")  # (they add up to the wall time)
    seconds: dict[str, dict[str, float]] = {}
    for g in (*report.fused, *report.to_xla):
        seconds.setdefault(g.kernel, dict(g.compile_s))
    lines = [f"  slowest of {len(seconds)} plans to compile ({' + '.join(steps)}, wall s, "
             "waits for other plans' measurements included):"]
    for kernel, s in sorted(seconds.items(),
                            key=lambda kv: -sum(kv[1].get(step, 0) for step in steps))[:top]:
        lines.append("    " + " + ".join(f"{s.get(step, 0):5.2f}" for step in steps) +
                     f"  {kernel[:90]}")
    return "\n".join(lines)


def _kernel_diff(plain: dict[str, float], auto: dict[str, float], top: int = 12) -> str:
    """The kernels whose time differs most between the plain and the auto program."""
    names = sorted(set(plain) | set(auto),
                   key=lambda k: -abs(auto.get(k, 0.0) - plain.get(k, 0.0)))[:top]
    lines = [f"  device time by kernel, plain vs auto (us), {len(plain)} vs {len(auto)} kernels:"]
    lines += [f"    {plain.get(k, 0.0) * 1e6:9.1f} {auto.get(k, 0.0) * 1e6:9.1f}  {k[:90]}"
              for k in names]
    return "\n".join(lines)


def _line(r: dict[str, Any]) -> str:
    nan = float("nan")
    cells = [f"{r['model']:<23} {r['batch']:>4} {r['devices']:>2} {r['dtype']:<9} "
             f"{r['plain_ms']:9.2f}"]
    for mode in ("auto", "fused"):
        if f"{mode}_error" in r:
            cells.append(f"{'ERROR':>9} {'':>7}")
        else:
            cells.append(f"{r.get(f'{mode}_ms', nan):9.2f} {r.get(f'{mode}_speedup', nan):7.2f}")
    cells.append(" ".join(f"{r.get(f'{k}_device_ms', nan):9.2f}"
                          for k in ("plain", "auto", "fused")))
    cells.append(f"{r.get('auto_fused_groups', 0):>4}/{r.get('auto_to_xla', 0):<4}")
    return " ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench.end_to_end",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["resnet50"], choices=sorted(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--solver", nargs="+", default=["auto", "fused"],
                        choices=["auto", "fused", "xla"],
                        help="solver modes of the fused program to time against plain jit")
    parser.add_argument("--devices", nargs="+", type=int, default=[1],
                        help="data-parallel over this many devices (batch sharded); per value")
    parser.add_argument("--platform", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    # Each row is printed and saved as soon as it is measured: a run cut at a time cap keeps
    # what it finished.
    print(f"device: {device.device_kind}")
    print(f"{'model':<23} {'N':>4} {'dev':>2} {'dtype':<9} {'plain ms':>9} {'auto ms':>9} "
          f"{'auto x':>7} {'fused ms':>9} {'fused x':>7} {'dev plain':>9} {'dev auto':>9} "
          f"{'dev fused':>9} fused/xla chains   seconds", flush=True)
    rows = []
    for name in args.model:
        for dtype in args.dtype:
            for batch in args.batch:
                for devices in args.devices:
                    start = time.perf_counter()
                    rows.append(run(name, batch, dtype, args.image, device,
                                    tuple(args.solver), devices))
                    rows[-1]["row_s"] = time.perf_counter() - start
                    print(f"{_line(rows[-1])} {rows[-1]['row_s']:9.0f}", flush=True)
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    if args.json:
                        _save(args.json, device, rows)
    return 0


def _save(path: Path, device: Any, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__,
                                "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
