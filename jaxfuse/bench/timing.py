"""Per-op timing of jitted functions.

Two measures, both from K distinct input sets run inside ONE ``jax.jit`` (a list comprehension,
so the K ops are straight-line code and no input stays cached between them):

- wall: call time after warm-up divided by K, median over repeats (the method of
  ``shared/perf``; per-argument dispatch is included once per call); programs compared with
  each other are timed in turns (:func:`wall_times_interleaved`), so a drift of the machine
  (another process) weighs on each alike, and runs that faulted their outputs' pages in are
  set aside as the find step sets them aside (:func:`jaxfuse.measure.quiet_runs`); on CPUs the
  fastest run counts rather than the median (see :func:`wall_times_interleaved`);
- device: the GPU kernels' own durations from a profiler trace (CUPTI), summed per call and
  divided by K, median over calls; launch gaps and host work excluded. GPU only. The programs
  a benchmark row compares share one trace (:func:`device_timings`).
- span (from the same trace): each call's first kernel start to its last kernel end, divided by
  K: the device's timeline with the gaps between kernels, close to what the find step's
  stopwatch marks measure (:class:`jaxfuse.measure.Harness`, which also holds the device until
  the host has queued the whole program; here a tiny program's gaps may be paced by its
  launches). A composition of several kernels pays a gap before each; the device measure
  leaves them out.
- queued (GPUs, :func:`queued_times`): the find step's own harness
  (:class:`jaxfuse.measure.Harness`) on the same functions and inputs: the device is held
  until the host has queued the whole program, then timed from the program's first kernel to
  its last. The gaps between kernels count, the pace of the host's launches does not: what a
  layer costs a network whose host runs ahead of its device. Busy time understates a
  composition of several kernels (no gaps) and span overstates it where its launches are
  slow (XLA's 3-5 kernels a chain take 20-50 us of host work at batch 64); on four H200s
  (2026-11-28) five cases sat below 0.97x by the one and above 1.7x by the other.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..measure import GPU_REWARM_SECONDS, Harness, Timing, device_timing, page_faults, quiet_runs

__all__ = ["DeviceTiming", "batched", "device_time_per_op", "device_timings", "queued_times",
           "wall_time_per_op", "wall_times_interleaved"]

logger = logging.getLogger("jaxfuse.bench")


def batched(fn: Callable[..., Any], chained: bool = False
            ) -> Callable[[Sequence[Sequence[Any]]], Any]:
    """``jit(lambda sets: [fn(*s) for s in sets])``: K ops in one program.

    `chained`: op k's inputs wait for op k-1's result (``lax.optimization_barrier``), as a
    network's layers do. Independent ops of one program are free to be merged: XLA's horizontal
    fusion runs K small loop fusions as one kernel, which no chain of layers allows. All of op
    k's inputs wait, its parameters too, so work on parameters alone (folding a batch norm,
    casting filters) cannot move ahead either, which a network's could."""
    if not chained:
        return jax.jit(lambda sets: [fn(*s) for s in sets])

    def many(sets: Sequence[Sequence[Any]]) -> list[Any]:
        outs: list[Any] = []
        for s in sets:
            if outs:
                s, _ = jax.lax.optimization_barrier((tuple(s), outs[-1]))
            outs.append(fn(*s))
        return outs

    return jax.jit(many)


def wall_time_per_op(many: Callable[[Any], Any], arg_sets: Sequence[Sequence[Any]],
                     repeats: int = 20, warmup: int = 3) -> float:
    """Median wall seconds per op of ``many(arg_sets)`` (see module docstring)."""
    return wall_times_interleaved({"": many}, arg_sets, repeats, warmup)[""]


def wall_times_interleaved(programs: dict[str, Callable[[Any], Any]],
                           arg_sets: Sequence[Sequence[Any]], repeats: int = 20,
                           warmup: int = 3,
                           statistic: Callable[[list[float]], float] = statistics.median,
                           dispatch: dict[str, float] | None = None) -> dict[str, float]:
    """Wall seconds per op of each of `programs` on `arg_sets` (`statistic` of the runs, by
    default the median), timed in turns (one call of each per round). On a 2-core VM
    (2026-11-25) timing XLA's batch-8 NA program in a block of its own gave 3.8-7.4 ms per op
    from one run of the benchmark to the next while the fused
    kernel's block gave 3.0 ms: the blocks saw different machines. The order rotates from round
    to round: with a fixed one (2026-11-26, same VM) the third program, the same kernel as the
    second, timed 1.6-1.7x slower at batch 8, each round (it ran on the memory the second had
    just freed, in pages the system had taken back). Rotating still left every other run of a
    program faulting its outputs in (2026-11-26, same VM: 3136 faults and 3x the time for a
    12.8 MB output, in XLA's program and the kernel's alike), and the median of such a mix
    swung by half between programs that run the same kernel: each program's faulting runs are
    set aside while it has quieter ones. Even so the medians of two programs with the same
    optimized HLO (an auto-mode plan that runs XLA's composition, and XLA's composition) came
    out up to 2x apart on that VM (2026-11-26, NA_C256 fp32 batch 8: 8.7 against 4.1 ms), as
    every run of either faulted by turns: the CPU benchmark passes ``statistic=min``, each
    program's least disturbed run.

    `dispatch`, if given, receives each program's seconds per op until its call returned,
    before the wait for its results (the same statistic of the same runs): where XLA runs a
    program's thunks on a thread of its own, the wait holds their host work too."""
    for _ in range(warmup):
        for many in programs.values():
            jax.block_until_ready(many(arg_sets))
    times: dict[str, list[float]] = {name: [] for name in programs}
    returned: dict[str, list[float]] = {name: [] for name in programs}
    faults: dict[str, list[int]] = {name: [] for name in programs}
    names = list(programs)
    for round_ in range(repeats):
        for i in range(len(names)):
            name = names[(round_ + i) % len(names)]
            faults_before = page_faults()
            start = time.perf_counter()
            out = programs[name](arg_sets)
            returned[name].append(time.perf_counter() - start)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - start)
            faults[name].append(page_faults() - faults_before)
            del out
    if dispatch is not None:  # (over the same runs, by the same statistic, as the wall time)
        dispatch.update({name: statistic(quiet_runs(r, faults[name])) / len(arg_sets)
                         for name, r in returned.items()})
    return {name: statistic(quiet_runs(t, faults[name])) / len(arg_sets)
            for name, t in times.items()}


@dataclasses.dataclass(frozen=True)
class DeviceTiming:
    """One program's kernels in a profiler trace, per op (see :func:`device_timings`)."""

    seconds: float  # median over calls of the time some kernel runs
    kernels_per_op: float
    span: float | None  # median over calls of first start to last end; None: calls not split
    by_kernel: dict[str, float]  # each kernel name's mean seconds (its durations)
    shared: bool = False  # from a trace shared with other programs (device_timings)


# Host sleep before each traced call: each call's kernels are then set apart from the last
# call's by a gap at least this long, which the split finds (a layer's own gaps between its
# kernels are launches, tens of microseconds). Short enough that the clocks stay up.
_CALL_GAP_SECONDS = 1e-3


def device_timings(programs: dict[str, tuple[Callable[[Any], Any], Sequence[Sequence[Any]]]],
                   calls: int = 5) -> dict[str, DeviceTiming | None]:
    """Device timings of several ``(many, arg_sets)`` programs from ONE profiler trace (a
    trace costs its setup and its file on each use), `calls` calls each, one after another.
    The kernels are split into calls at the gaps the sleeps between calls leave; where that
    split is not clean (a program with a gap of its own that long), each program is traced
    on its own and its calls split at its largest gaps. None for a program without GPU
    kernels (CPUs)."""
    for many, arg_sets in programs.values():
        jax.block_until_ready(many(arg_sets))

    def run_all() -> None:
        for many, arg_sets in programs.values():
            for _ in range(calls):
                time.sleep(_CALL_GAP_SECONDS)
                jax.block_until_ready(many(arg_sets))

    kernels = _traced_kernels(run_all)
    groups = _split(kernels, len(programs) * calls, min_gap_ns=_CALL_GAP_SECONDS * 1e9 / 2)
    if groups is not None and not all(
            _alike(groups[i * calls:(i + 1) * calls]) for i in range(len(programs))):
        groups = None  # (a program's calls differ: the cuts fell elsewhere than between calls)
    if groups is None and kernels and len(programs) > 1:
        return {name: device_timings({name: program}, calls)[name]
                for name, program in programs.items()}
    if groups is None and kernels:  # one program: split at its largest gaps, whatever they are
        groups = _split(kernels, calls, min_gap_ns=0) or [list(kernels)]
    result: dict[str, DeviceTiming | None] = {}
    for index, (name, (_, arg_sets)) in enumerate(programs.items()):
        mine = groups[index * calls:(index + 1) * calls] if groups else None
        timing = _timing(mine, len(arg_sets), calls) if mine else None
        result[name] = (dataclasses.replace(timing, shared=len(programs) > 1)
                        if timing else None)
    return result


def queued_times(functions: dict[str, Callable[..., Any]], arg_sets: Sequence[Sequence[Any]],
                 device: Any, windows: int = 2) -> dict[str, Timing | None]:
    """Per op, each function's queued device time and its host (launch) time on `arg_sets`,
    through the find step's harness (see the module docstring); None for a function whose
    program does not compile. Windows alternate the order, and each function keeps its lower
    times, as the find step's second window does; they hold the process's device-timing lock.
    GPUs only (on CPUs the harness times wall clock)."""
    result: dict[str, Timing | None] = {}
    with device_timing():
        harnesses: dict[str, Harness] = {}
        for name, fn in functions.items():
            try:  # (the harness appends the runtime scalars, which these functions close over)
                harnesses[name] = Harness.compile(lambda *a, f=fn: f(*a[:-1]), arg_sets, device)
            except Exception as err:
                logger.warning("queued measure: %s does not compile: %s", name, err)
                result[name] = None
        order = list(harnesses)
        for window in range(windows):
            for name in order if window % 2 == 0 else order[::-1]:
                warm_up = {"warm_up": GPU_REWARM_SECONDS} if window else {}
                try:  # (a failure, out of memory say, costs this measure, not the sweep)
                    timing = harnesses[name].run(**warm_up)[1]
                except Exception as err:
                    logger.warning("queued measure: %s failed: %s", name, err)
                    result.setdefault(name, None)
                    continue
                best = result.get(name)
                result[name] = timing if best is None else Timing(
                    min(best.device, timing.device), min(best.host, timing.host))
    return result


def _alike(calls_kernels: list[list[Kernel]]) -> bool:
    """Whether every call launched the same kernels (by name and count)."""
    names = [sorted(name for _, _, name in k) for k in calls_kernels]
    return all(n == names[0] for n in names)


def device_time_per_op(many: Callable[[Any], Any], arg_sets: Sequence[Sequence[Any]],
                       calls: int = 5, by_kernel: dict[str, float] | None = None
                       ) -> float | None:
    """Median GPU-kernel seconds per op, from a profiler trace; None without GPU events: the
    time some kernel runs, kernels that overlap counted once. (A kernel that XLA's command
    buffer starts before the previous one ends, programmatic dependent launch, waits for it
    inside its own duration: summed durations would count that wait as the kernel's time.)
    `by_kernel`, if given, receives each kernel name's mean seconds per op (its durations).
    (:func:`device_timings` gives kernels per op and the span too.)"""
    timing = device_timings({"": (many, arg_sets)}, calls)[""]
    if timing is None:
        return None
    if by_kernel is not None:
        for name, seconds in timing.by_kernel.items():
            by_kernel[name] = by_kernel.get(name, 0.0) + seconds
    return timing.seconds


Kernel = tuple[int, int, str]  # start ns, duration ns, name


def _traced_kernels(run: Callable[[], None]) -> list[Kernel]:
    """The GPU kernels `run` launches, from a profiler trace, sorted by start."""
    return sorted((start, duration, name) for _, name, start, duration in traced_events(run))


def traced_events(run: Callable[[], None], host: bool = False
                  ) -> list[tuple[str, str, int, int]]:
    """``(where, name, start ns, duration ns)`` of the events of a profiler trace of `run`:
    the GPU kernels (where ``"device"``) and, with `host`, the host threads' events (where:
    the thread's name). Empty where the profiler wrote no trace."""
    from jax.profiler import ProfileData

    events: list[tuple[str, str, int, int]] = []
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            run()
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        if not files:
            return events
        data = ProfileData.from_file(files[0])
        for plane in data.planes:
            on_device = plane.name.startswith("/device:GPU")
            if not (on_device or (host and plane.name.startswith("/host:"))):
                continue
            for line in plane.lines:
                # Stream lines hold the kernels; "XLA Ops"/"XLA Modules" lines repeat them.
                if on_device and not line.name.startswith("Stream"):
                    continue
                where = "device" if on_device else line.name
                events += [(where, e.name, e.start_ns, e.duration_ns) for e in line.events]
    return events


def _split(kernels: Sequence[Kernel], count: int, min_gap_ns: float
           ) -> list[list[Kernel]] | None:
    """`kernels` (sorted) cut at their count - 1 largest gaps between one kernel's end (the
    latest so far) and the next start; None unless there are that many kernels and exactly
    count - 1 gaps of at least `min_gap_ns` (where that is above 0)."""
    if len(kernels) < count:
        return None
    gaps, end = [], kernels[0][0] + kernels[0][1]
    for i in range(1, len(kernels)):
        gaps.append((kernels[i][0] - end, i))
        end = max(end, kernels[i][0] + kernels[i][1])
    cuts = sorted(gaps, reverse=True)[:count - 1]
    if min_gap_ns > 0 and (sum(gap >= min_gap_ns for gap, _ in gaps) != count - 1):
        return None
    bounds = [0, *sorted(i for _, i in cuts), len(kernels)]
    return [list(kernels[a:b]) for a, b in itertools.pairwise(bounds)]


def _timing(calls_kernels: list[list[Kernel]], ops: int, calls: int) -> DeviceTiming:
    intervals = [[(start, duration) for start, duration, _ in k] for k in calls_kernels]
    by_kernel: dict[str, float] = {}
    for k in calls_kernels:
        for _, duration, name in k:
            by_kernel[name] = by_kernel.get(name, 0.0) + duration * 1e-9 / (calls * ops)
    # (fewer kernels than calls: one group, whose span would count the gaps between calls)
    split = len(calls_kernels) == calls
    busy = (statistics.median(busy_ns(k) for k in intervals) if split
            else busy_ns(intervals[0]) / calls)
    return DeviceTiming(
        seconds=busy * 1e-9 / ops,
        kernels_per_op=sum(len(k) for k in calls_kernels) / (calls * ops),
        span=statistics.median(span_ns(k) for k in intervals) * 1e-9 / ops if split else None,
        by_kernel=by_kernel)


def span_ns(kernels: Sequence[tuple[int, int]]) -> int:
    """From the first start to the last end of (start, duration) intervals sorted by start."""
    if not kernels:
        return 0
    return max(start + duration for start, duration in kernels) - kernels[0][0]


def busy_ns(kernels: Sequence[tuple[int, int]]) -> int:
    """The length of the union of (start, duration) intervals sorted by start."""
    return sum(exposed_ns(kernels))


def exposed_ns(kernels: Sequence[tuple[int, int]]) -> list[int]:
    """Each of the (start, duration) intervals, sorted by start: its part past the end of
    every earlier one. The parts sum to the intervals' union."""
    parts, end = [], kernels[0][0] if kernels else 0
    for start, duration in kernels:
        parts.append(max(0, start + duration - max(start, end)))
        end = max(end, start + duration)
    return parts
