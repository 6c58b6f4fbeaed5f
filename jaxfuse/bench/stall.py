"""Where an awaited call's time goes once it has returned: the timeline of one call.

The layer benchmark's wall column (one call of K ops, awaited) put a fused program far behind
its device time in a few rows of each sweep (four H200s, 2026-11-28: up to about 0.5 ms an
op past the call's return, against 3-100 us an op on the device, in 2-23% of the fused rows
of a run, never the same rows twice). With ``--probe-stalls`` the benchmark calls
:func:`awaited_timeline` on such a program, in the same process: the return and ready times
of ten awaited calls of it alone, and every host and device event of one awaited call
relative to its start (the graph launch, the kernels, the wait for the results)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from .timing import traced_events

_MARK = "jaxfuse_awaited_call"


def awaited_runs(program: Callable[[Any], Any], args: Any, calls: int = 10
                 ) -> list[list[float]]:
    """[returned, ready] microseconds (to 0.1) of `calls` awaited calls, each from its start."""
    runs = []
    for _ in range(calls):
        start = time.perf_counter()
        out = program(args)
        returned = time.perf_counter() - start
        jax.block_until_ready(out)
        runs.append([round(returned * 1e6, 1), round((time.perf_counter() - start) * 1e6, 1)])
        del out
    return runs


def control_program() -> Callable[[Any], Any]:
    """XLA's program for a call's input sets that scales each set's first input: one small
    kernel, dispatched about as fast as a fused program, against which a stall is judged."""
    return jax.jit(lambda sets: [operands[0] * 2 for operands in sets])


def awaited_timeline(program: Callable[[Any], Any], args: Any, calls: int = 4,
                     limit: int = 120) -> dict[str, Any]:
    """Awaited runs' times, then a profiler trace of `calls` awaited calls, and the events of
    the last one: ``[where, name, start_us, duration_us]`` by start, relative to the call's
    start (``where``: ``"device"`` or the host thread's name; the first and last `limit` / 2
    where there are more), with its milestones (graph launches, kernels, the wait for its
    results: ``[start, end]`` each)."""
    runs = awaited_runs(program, args)

    def awaited_calls() -> None:
        for _ in range(calls):
            with jax.profiler.TraceAnnotation(_MARK):
                jax.block_until_ready(program(args))

    traced = traced_events(awaited_calls, host=True)
    marks = [(start, start + duration) for _, name, start, duration in traced if name == _MARK]
    events = [e for e in traced if e[1] != _MARK]
    if not marks:  # (no trace written)
        return {"runs_us": runs, "call_us": None, "milestones_us": None, "events": []}
    begin, end = max(marks)
    window = sorted((e for e in events if begin <= e[2] <= end and _worth_keeping(e[1])),
                    key=lambda e: e[2])
    kernels = [e for e in window if e[0] == "device"]
    waits = [e for e in window if "block_until_ready" in e[1]]
    launches = [e for e in window if "GraphLaunch" in e[1]]

    def rel(ns: float) -> float:
        return round((ns - begin) / 1e3, 1)

    return {
        "runs_us": runs,
        "call_us": rel(end),
        # The call's milestones: its graph launches, its kernels, its wait for the results.
        "milestones_us": {
            "launch": [rel(launches[0][2]), rel(launches[-1][2] + launches[-1][3])]
            if launches else None,
            "kernels": [rel(kernels[0][2]), rel(max(e[2] + e[3] for e in kernels))]
            if kernels else None,
            "wait": [rel(waits[-1][2]), rel(waits[-1][2] + waits[-1][3])] if waits else None,
        },
        "events": [[where, name[:60], rel(start), round(dur / 1e3, 1)]
                   for where, name, start, dur in (
                       window[:limit // 2] + window[len(window) - limit // 2:]
                       if len(window) > limit else window)],
    }


def _worth_keeping(name: str) -> bool:
    """Python's own calls ("$...") are left out but for the call and the wait: the tracer
    records every builtin the wait's tree walk makes, which crowded out the device's kernels."""
    return not name.startswith("$") or "block_until_ready" in name or "__call__" in name


def describe(timeline: dict[str, Any], top: int = 12) -> str:
    """A few lines for the log: the runs and the longest events of the call."""
    lines = [f"  awaited calls of K ops (returned/ready us): {timeline['runs_us']}",
             f"  traced call: {timeline.get('call_us')} us; from its start (us): "
             f"{timeline.get('milestones_us')}"]
    longest = sorted(timeline["events"], key=lambda e: -e[3])[:top]
    lines += [f"    {start:8.1f} +{dur:7.1f} us  {where[:24]:24s} {name}"
              for where, name, start, dur in sorted(longest, key=lambda e: e[2])]
    return "\n".join(lines)
