"""Where an awaited call's time goes once it has returned: the timeline of one call.

The layer benchmark flags a program whose awaited call waits far longer after returning than
its kernels run (on four H200s, 2026-11-28: about 245 us per op of wall time against 3-11 us
of device time, in about 4% of the fused rows, never the same rows twice, and never in a
process that timed only those rows). :func:`awaited_timeline` then records, in the same
process, the runs' return and ready times and every host and device event of one awaited call,
relative to its start: the graph launch, the kernels, and what the host did until the results
were ready.
"""

from __future__ import annotations

import glob
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

_MARK = "jaxfuse_awaited_call"


def awaited_runs(program: Callable[[Any], Any], args: Any, calls: int = 10
                 ) -> list[tuple[float, float]]:
    """(returned, ready) microseconds of `calls` awaited calls, each from its start."""
    runs = []
    for _ in range(calls):
        start = time.perf_counter()
        out = program(args)
        returned = time.perf_counter() - start
        jax.block_until_ready(out)
        runs.append((returned * 1e6, (time.perf_counter() - start) * 1e6))
        del out
    return runs


def awaited_timeline(program: Callable[[Any], Any], args: Any, calls: int = 4,
                     limit: int = 80) -> dict[str, Any]:
    """Awaited runs' times, then a profiler trace of `calls` awaited calls, and the events of
    the last one: ``[where, name, start_us, duration_us]`` by start, relative to the call's
    start (``where``: ``"device"`` or the host thread's name)."""
    from jax.profiler import ProfileData

    runs = awaited_runs(program, args)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(calls):
                with jax.profiler.TraceAnnotation(_MARK):
                    jax.block_until_ready(program(args))
        data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    events: list[tuple[str, str, int, int]] = []
    marks: list[tuple[int, int]] = []
    for plane in data.planes:
        on_device = plane.name.startswith("/device:GPU")
        if not (on_device or plane.name.startswith("/host:")):
            continue
        for line in plane.lines:
            if on_device and not line.name.startswith("Stream"):
                continue
            for e in line.events:
                if e.name == _MARK:
                    marks.append((e.start_ns, e.end_ns))
                else:
                    where = "device" if on_device else line.name
                    events.append((where, e.name, e.start_ns, e.duration_ns))
    if not marks:
        return {"runs_us": runs, "events": []}
    begin, end = max(marks)
    window = sorted((e for e in events if begin <= e[2] <= end), key=lambda e: e[2])
    return {
        "runs_us": [[round(r, 1), round(w, 1)] for r, w in runs],
        "call_us": round((end - begin) / 1e3, 1),
        "events": [[where, name[:60], round((start - begin) / 1e3, 1), round(dur / 1e3, 1)]
                   for where, name, start, dur in window[:limit]],
    }


def describe(timeline: dict[str, Any], top: int = 12) -> str:
    """A few lines for the log: the runs and the longest events of the call."""
    lines = [f"  awaited runs (returned/ready us): {timeline['runs_us']}",
             f"  traced call: {timeline.get('call_us')} us"]
    longest = sorted(timeline["events"], key=lambda e: -e[3])[:top]
    lines += [f"    {start:8.1f} +{dur:7.1f} us  {where[:24]:24s} {name}"
              for where, name, start, dur in sorted(longest, key=lambda e: e[2])]
    return "\n".join(lines)
