"""Where a small-batch forward pass spends its time: host work per call, by event name, and
the device's kernels, for plain ``jax.jit(apply)`` and ``jax.jit(fuse(apply))``.

    XLA_FLAGS=... python scripts/latency_probe.py --model resnet50 --dtype bfloat16 --batch 1
    python scripts/latency_probe.py --layer resnet50_net/r50n_7_512_2048 --layout NCHW \
        --dtype float32 --batch 8     # one layer benchmark case: XLA's program and the kernel's

Prints, per program: wall time per call (back-to-back calls, every output kept, and with
only the last one alive), the sum of kernel time per call,
kernels and CUDA-graph launches per call, the host events and the device kernels that take the
most time per call (from a profiler trace of `--calls` calls). Run it once per XLA_FLAGS
setting to compare them.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import jax

from jaxfuse import fuse, fusion_report
from jaxfuse.bench.end_to_end import MODELS, back_to_back, forward_seconds, model_inputs
from jaxfuse.bench.timing import exposed_ns, span_ns, traced_events, wall_times_interleaved


def trace_summary(fn, args, calls: int, keep_outputs: bool = True) -> dict:
    """Per-call host event times by name and device kernel statistics, from one trace of
    back-to-back calls (every output kept, or each dropped once the next call is queued)."""
    jax.block_until_ready(fn(*args))
    events = traced_events(
        lambda: jax.block_until_ready(back_to_back(fn, args, calls, keep_outputs)), host=True)
    host: dict[str, list[float]] = collections.defaultdict(list)
    device: dict[str, list[float]] = collections.defaultdict(list)
    intervals = []
    for where, name, start, duration in events:
        if where == "device":
            device[name].append(duration)
            intervals.append((start, duration, name))
        else:
            host[name].append(duration)
    exposed = exposed_by_name(intervals)

    def top(events: dict[str, list[float]], count: int) -> list[tuple[str, float, float]]:
        ranked = sorted(events.items(), key=lambda kv: -sum(kv[1]))[:count]
        return [(name[:70], len(v) / calls, sum(v) / calls / 1e3) for name, v in ranked]

    return {
        "kernels_per_call": sum(len(v) for v in device.values()) / calls,
        "kernel_us_per_call": sum(sum(v) for v in device.values()) / calls / 1e3,
        # Kernels that overlap counted once (one that starts before the previous one ends,
        # by programmatic dependent launch, waits for it within its own duration).
        "kernel_busy_us_per_call": sum(map(sum, exposed.values())) / calls / 1e3,
        # The device's period a call, gaps included: near the wall time when the device is
        # what limits back-to-back calls.
        "device_span_us_per_call": span_ns(sorted(i[:2] for i in intervals)) / calls / 1e3,
        "graph_launches_per_call": sum(len(v) for k, v in host.items()
                                       if "GraphLaunch" in k) / calls,
        "host_top": top(host, 18),
        # XLA's own per-call stages and every custom call's, wherever they rank
        "host_watch": [row for row in top(host, len(host)) if any(
            word in row[0] for word in ("Initialize", "update", "Launch", "CustomCall",
                                        "custom_call", "Prepare", "ParseArguments"))],
        "device_top": top(device, 12),
        # Per kernel name, the time only it ran (its interval past every earlier kernel's):
        # where a call's device time goes once launches overlap.
        "device_exposed": top(exposed, 12),
    }


def exposed_by_name(intervals: list[tuple[int, int, str]]) -> dict[str, list[float]]:
    """Each (start, duration, name) interval's part past the end of every earlier one (by
    start), listed by name: the parts sum to the intervals' union."""
    ordered = sorted(intervals)
    out: dict[str, list[float]] = collections.defaultdict(list)
    for (_, _, name), part in zip(ordered, exposed_ns([i[:2] for i in ordered])):
        out[name].append(part)
    return out


def handler_stats(fn, args, calls: int) -> dict[str, float]:
    """Per call, over back-to-back calls with every output kept: the fused calls' record-stage
    updates and the tensor maps encoded, with their host microseconds (jaxfuse's own share
    of XLA's command-buffer update)."""
    from jaxfuse._extension import extension

    jax.block_until_ready(fn(*args))
    before = extension().gpu_stats()
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    after = extension().gpu_stats()
    return {key: (after.get(key, 0) - before.get(key, 0)) / calls / (1e3 if "_ns" in key else 1)
            for key in ("record_updates", "record_update_ns", "tensor_map_encodes",
                        "tensor_map_encode_ns")}


def awaited_seconds(fn, args, calls: int = 20) -> tuple[float, float]:
    """Median seconds of a call awaited before the next starts, and of its part until the
    call returned: the layer benchmark's wall and dispatch times (one op a call here)."""
    dispatch: dict[str, float] = {}
    wall = wall_times_interleaved({"": lambda _: fn(*args)}, [()], repeats=calls, warmup=1,
                                  dispatch=dispatch)
    return wall[""], dispatch[""]


def fresh_input_seconds(fn, args, pool, calls: int = 20, repeats: int = 7) -> float:
    """As `forward_seconds` with one output alive, but each call takes the next input of
    `pool` in place of the last argument."""
    head = tuple(args[:-1])
    jax.block_until_ready(fn(*head, pool[0]))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            out = fn(*head, pool[i % len(pool)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def layer_programs(spec: str, dtype: str, batch: int, layout: str, solver: str) -> dict:
    """A layer benchmark case's programs as the benchmark compiles them (K input sets in one
    program, jaxfuse.bench's run_case): XLA's composition and the plan with `solver`."""
    from jaxfuse.bench.__main__ import compiled_program
    from jaxfuse.bench.cases import BenchCase
    from jaxfuse.bench.layers import SUITES
    from jaxfuse.bench.timing import batched

    suite, name = spec.split("/")
    layer = next(layer for layer in SUITES[suite] if layer.name == name)
    ops = "NA" if not layer.has_conv else "CBNSA" if layer.residual else "CBNA"
    case = BenchCase.for_layer(layer, batch, dtype, layout, ops if layer.activation else
                               ops.replace("A", ""))
    device = jax.devices()[0]
    args = case.arg_sets(8 if batch > 1 else 16, device)
    plan, plan_ops = case.plan(device, solver=solver)
    print(f"-- {case.label()}: {plan.kernel_info.get('solver')} "
          f"{plan.kernel_info.get('tile', '')}, {len(args)} sets a call")
    return {"xla": (compiled_program(batched(case.unfused()), args)[0], (args,)),
            solver: (compiled_program(batched(case.fused(plan, plan_ops)), args)[0], (args,))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    parser.add_argument("--layer", default=None, metavar="SUITE/LAYER",
                        help="a layer benchmark case instead of a model")
    parser.add_argument("--layout", default="NHWC", help="--layer's layout")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--closure", action="store_true",
                        help="also time the fused program with the variables closed over "
                             "(constants of the program, not arguments of each call)")
    opts = parser.parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"== {opts.layer or opts.model} {opts.dtype} N={opts.batch} XLA_FLAGS={flags!r}")
    if opts.layer:
        report_programs(layer_programs(opts.layer, opts.dtype, opts.batch, opts.layout,
                                       opts.solver), opts.calls, pool=None)
        return
    model, variables, x = model_inputs(opts.model, opts.dtype, opts.batch)
    variables, x = jax.device_put((variables, x))
    fused = fuse(model.apply, solver=opts.solver)
    programs = {"plain": (jax.jit(model.apply), (variables, x)),
                opts.solver: (jax.jit(fused), (variables, x))}
    if opts.closure:  # the input the only argument of each call
        programs["plain, variables closed over"] = (
            jax.jit(lambda x: model.apply(variables, x)), (x,))
        programs[f"{opts.solver}, variables closed over"] = (
            jax.jit(lambda x: fused(variables, x)), (x,))
    report = fusion_report(fused, variables, x)
    print(f"-- {opts.solver}: {report.fused_calls} fused calls, {len(report.to_xla)} chains left "
          f"to XLA, {report.converts_batched} conversions batched into one op")
    # What JAX and XLA take to dispatch any program of these arguments: one small kernel.
    floor = jax.jit(lambda variables, x: x * 2)
    print(f"-- floor (one kernel, the same arguments): wall "
          f"{forward_seconds(floor, (variables, x), calls=20) * 1e6:.0f} us/call; "
          f"of the input alone {forward_seconds(floor, ((), x), calls=20) * 1e6:.0f} us/call")
    # A server's calls: a new input each time (a pool of distinct arrays, cycled), so XLA
    # sees the input buffer move, as it does when every output is kept.
    pool = [jax.random.normal(jax.random.key(i), x.shape, x.dtype) for i in range(8)]
    report_programs(programs, opts.calls, pool)


def report_programs(programs: dict, calls: int, pool: list | None) -> None:
    """Wall times, trace summaries and handler counters of each (fn, args) of `programs`;
    `pool`: inputs to cycle through in place of the last argument (None: not timed so)."""
    for name, (fn, args) in programs.items():
        wall = forward_seconds(fn, args, calls=20) * 1e6
        wall_one = forward_seconds(fn, args, calls=20, keep_outputs=False) * 1e6
        fresh = ""
        if pool is not None:
            fresh = f", {fresh_input_seconds(fn, args, pool) * 1e6:.0f} with one alive and a " \
                    "new input each call"
        awaited, returned = (seconds * 1e6 for seconds in awaited_seconds(fn, args))
        s = trace_summary(fn, args, calls)
        print(f"-- {name}: wall {wall:.0f} us/call ({wall_one:.0f} with one output alive"
              f"{fresh}; {awaited:.0f} a call awaited, {returned:.0f} of it until it "
              f"returned), "
              f"kernels {s['kernels_per_call']:.0f}/call "
              f"= {s['kernel_us_per_call']:.0f} us ({s['kernel_busy_us_per_call']:.0f} us "
              f"overlaps counted once) over a device span of "
              f"{s['device_span_us_per_call']:.0f} us, "
              f"graph launches {s['graph_launches_per_call']:.1f}/call")
        for event, count, us in s["host_top"]:
            print(f"   {us:8.1f} us {count:6.1f}x  {event}")
        print("   watched host events:")
        for event, count, us in s["host_watch"]:
            print(f"   {us:8.1f} us {count:6.1f}x  {event}")
        print("   device kernels:")
        for kernel, count, us in s["device_top"]:
            print(f"   {us:8.1f} us {count:6.1f}x  {kernel}")
        print("   device kernels, time past the earlier kernels' ends (sums to the union):")
        for kernel, count, us in s["device_exposed"]:
            print(f"   {us:8.1f} us {count:6.1f}x  {kernel}")
        if jax.devices()[0].platform == "gpu":
            h = handler_stats(fn, args, calls)
            print(f"   jaxfuse's handlers a call, every output kept: {h['record_updates']:.1f} "
                  f"record updates in {h['record_update_ns']:.1f} us, "
                  f"{h['tensor_map_encodes']:.1f} tensor maps encoded in "
                  f"{h['tensor_map_encode_ns']:.1f} us")
        one = trace_summary(fn, args, calls, keep_outputs=False)
        print(f"   with one output alive: kernels {one['kernel_us_per_call']:.0f} us "
              f"({one['kernel_busy_us_per_call']:.0f} us overlaps counted once) over a "
              f"device span of {one['device_span_us_per_call']:.0f} us; watched host events:")
        for event, count, us in one["host_watch"]:
            print(f"   {us:8.1f} us {count:6.1f}x  {event}")


if __name__ == "__main__":
    main()
