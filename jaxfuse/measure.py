"""Timing a plan's candidate solvers on a device, in one harness for all of them.

Every candidate is a traceable function of the primitive's operands. Each is compiled into one
``jax.jit`` program that runs it on K distinct random input sets (straight-line code, so the
K runs follow each other as a model's layers do), and the program is run several times; the
time per run is the median over those of (program time / K), on CPUs the fastest quiet run's
(:func:`quiet_runs`), as the layer benchmark takes it. On GPUs two times are taken
between two stopwatch marks: the device's (with the device held until the host has queued
the whole program, so the pace of launches does not count) and the host's; a candidate costs
the longer of the two (:class:`Timing`). On CPUs the time is wall time. All candidates take the same
operands. The runtime scalars (epsilon, activation parameters) are constants of the program,
as they are when a plan runs with concrete scalars, so XLA may fold them as it would there.

Measurements hold the extension's device-timing lock (shared with the kernel autotuner), so
plans compiled concurrently never time each other's work; compiling the programs happens under
it too, since XLA's own autotuning runs kernels on the device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._extension import STOPWATCH_TARGET, extension
from .runtime import gpu_ordinal, gpu_platform
from .signature import SCALARS, PlanSignature

__all__ = ["GPU_REWARM_SECONDS", "TIMING_SCALARS", "Harness", "Timing",
           "compile_helper_programs", "device_timing", "holds_device_timing", "operand_shapes",
           "page_faults", "quiet_runs", "random_operands", "relative_error", "set_count",
           "sets_bytes"]

# What the K input sets may take, in bytes (on CPUs, where a call's overhead is small beside a
# millisecond-scale op, sets beyond the first are only for tiny problems); how many timed runs
# (at least, and at most while the time budget lasts).
_SET_BUDGET = {"cpu": 4 << 20, "gpu": 256 << 20}
_MAX_SETS = 8
# GPUs: no more sets than it takes for them to cover the L2 cache this many times over. The
# sets only keep a run from finding its operands in L2, left there by its last run; once the
# other sets' traffic between two runs of one set exceeds the L2, that set is gone from it
# (with least-recently-used eviction, sets covering it once are enough), and each further set
# costs the find step the load of one more copy of XLA's candidate (the first run of each
# convolution of the program builds its cuDNN plan, again in every new executable). H100,
# 2026-12-07, mb2_dw_7_960 bf16 NHWC at batch 256, 48 MB a set (scripts/sets_probe.py): XLA's
# load took 0.16, 0.28, 0.52 and 0.82 s on 1, 2, 3 and 5 sets, and on 2 sets (1.84 times the
# L2) both candidates timed within 2% of their times on 5 (4.6 times).
_GPU_CACHE_COVER = 1.5
# ... but at least two where the budget allows: a program of one set counts the fixed cost of
# its start once a set, 2-4 us more for XLA's composition than for the fused kernel (H100,
# 2026-12-07: XLA's mb2_dw_7_960 per set 52.3 us on one set, 50.5 on two, 49.6 on five; the
# fused kernel's 21.4, 21.2, 19.6), as much as the choice's margin on a 100 us op.
_GPU_MIN_SETS = 2
# CPUs: filters this large, read for at most _CPU_COLD_PIXELS output pixels a set (so that
# reading them, not the arithmetic, sets the pace), are timed cold (set_count): the sets'
# filters together exceed a last-level cache of this size. Others would need more sets than
# _MAX_SETS, or sets that each take milliseconds: on the 2-core VM (2026-11-27) ResNet-50's
# 3x3 256 bf16 chain at batch 8 (1.2 MB of filters) took 2.35 s to choose on eight sets and
# its 3x3 512 chain at batch 8 2.1-2.4 s on four to seven, above issue #11's 2 s.
_CPU_CACHE_BYTES = 32 << 20
# CPUs: plans without a convolution (tens to hundreds of microseconds a set at batch 1 and 8)
# are timed on at least this many sets, one after another (Harness.compile's `sequential`).
# On one set, on the 2-core VM (2026-11-27), XLA's loop for batch-1 NA chains timed 1.3-2x
# its time among the layer benchmark's 16 sets, while the fused kernel timed the same, and the
# find step kept the fused kernel for every fp32 and fp16 chain, 6 of 12 slower in the
# benchmark (0.68-0.95x); on 8 sequential sets it kept XLA's for most of them. Only while the
# sets take at most _CPU_POINTWISE_BYTES: a batch-8 chain of 64 channels of 112x112 in fp32
# (51 MB a set) timed XLA's loop 2.6x slow on 8 sets (faulting in 100 MB of outputs a run).
_CPU_SETS = 8
_CPU_POINTWISE_BYTES = 64 << 20
# CPUs: plans with a convolution, while their sets take at most _CPU_CONV_BYTES, likewise (side
# by side, as the layer benchmark runs them). On one to three sets, on the 2-core VM
# (2026-11-28), XLA's composition of fp16 NCHW 1x1 chains timed 1.4-1.8x its time on eight
# (96->576 at 14x14, batch 8: 2052-2087 against 1260-1286 us) while the fused kernel timed the
# same, and the find step kept kernels the benchmark timed at 0.80-0.93x; on eight sets it kept
# XLA's, as the benchmark's times would. Larger sets take milliseconds each: eight of them
# would cost the find step seconds (ResNet-50's 3x3 256 bf16 chain at batch 8 took 2.35 s).
_CPU_CONV_BYTES = 16 << 20
_CPU_COLD_FILTERS = _CPU_CACHE_BYTES // _MAX_SETS
_CPU_COLD_PIXELS = 256
# GPUs: operands up to this many elements are drawn on the host and copied, larger ones on the
# device (a program compiled for each shape; NumPy takes ~10 ns an element on the host).
_HOST_RANDOM_ELEMENTS = 1 << 20
# Timed runs keep this many earlier runs' outputs alive (up to this many bytes in all), so each
# run writes to new addresses as a model's calls do (see Harness.run).
_KEPT_RUNS = 17
_KEPT_BYTES = 1 << 30
_MIN_RUNS = {"cpu": 3, "gpu": 5}
# GPUs: runs this long need only _MIN_RUNS_LONG timed runs (their noise is small beside them);
# XLA's depthwise composition at batch 256 takes tens of milliseconds a run.
_LONG_RUN_SECONDS = 0.01
_MIN_RUNS_LONG = 3
_MAX_RUNS = 20
_BUDGET_SECONDS = {"cpu": 0.1, "gpu": 0.05}
# GPUs: untimed runs for this long before the timed ones, so that a candidate is not timed
# while the clocks still rise from idle (after the host compiled it): a window of a few
# milliseconds of device work is over before they have.
_GPU_WARM_SECONDS = 0.02
# ... and before a later window, after the host compared the candidates' outputs.
GPU_REWARM_SECONDS = 0.005

# The runtime scalars candidates are timed with: meaningful for every activation mode.
_SCALARS = {"conv_alpha": 1.0, "bn_epsilon": 1e-3, "act_alpha": 0.1, "act_beta": 1.0,
            "act_gamma": 1.0, "side_alpha": 1.0}
TIMING_SCALARS = np.asarray([_SCALARS.get(name, 0.0) for name in SCALARS], np.float32)


_holder = threading.local()  # .holds: whether this thread holds the device-timing lock


@contextlib.contextmanager
def device_timing() -> Iterator[None]:
    """Holds the process's device-timing lock (one measurement at a time). It is not
    re-entrant: a thread that asks for it again raises rather than waiting for itself."""
    if holds_device_timing():
        raise RuntimeError("jaxfuse: this thread already holds the device-timing lock "
                           "(jaxfuse.measure.device_timing), which is not re-entrant")
    ext = extension()
    ext.timing_acquire()
    _holder.holds = True
    try:
        yield
    finally:
        _holder.holds = False
        ext.timing_release()


def holds_device_timing() -> bool:
    """Whether this thread holds the device-timing lock (:func:`device_timing`)."""
    return getattr(_holder, "holds", False)


def _platform_kind(device: Any) -> str:
    return "cpu" if device.platform.lower() == "cpu" else "gpu"


_l2_bytes: dict[tuple[str, int], int] = {}  # by (platform, ordinal): what the driver said


def gpu_l2_bytes(device: Any) -> int:
    """`device`'s L2 cache in bytes, 0 where the driver does not tell (ROCm) or fails (asked
    again next time)."""
    try:
        where = (gpu_platform(device), gpu_ordinal(device))
        if where not in _l2_bytes:
            _l2_bytes[where] = int(extension().gpu_l2_bytes(*where))
        return _l2_bytes[where]
    except Exception:  # (an extension without the binding, a driver that refuses)
        return 0


def set_count(signature: PlanSignature, device: Any) -> int:
    """How many distinct input sets fit the harness's memory budget (1 to 8), on GPUs no
    more than cover the L2 cache :data:`_GPU_CACHE_COVER` times over (and at least
    :data:`_GPU_MIN_SETS` where the budget allows). On CPUs at
    least :data:`_CPU_SETS` while they take at most :data:`_CPU_CONV_BYTES`
    (:data:`_CPU_POINTWISE_BYTES` without a convolution), and, for filters of
    :data:`_CPU_COLD_FILTERS` or more read for at most :data:`_CPU_COLD_PIXELS` output pixels,
    at least enough that their filters together exceed :data:`_CPU_CACHE_BYTES`.

    A network reads each layer's filters from memory once a call, so a candidate timed on
    one set of filters, hot in the cache from run to run, is timed in conditions no model
    gives it: on a 2-core VM (2026-11-27) ResNet-50's 3x3 512->512 fp32 chain at batch 1
    (9.4 MB of filters) timed 1.7x faster fused than XLA's composition on one set and at par
    on eight, and the layer benchmark, whose sets are distinct, timed it 0.92-1.04x."""
    nbytes = _bytes(signature.operands)
    nbytes += math.prod(signature.output_shape) * signature.dtype.itemsize
    kind = _platform_kind(device)
    count = int(min(_MAX_SETS, max(1, _SET_BUDGET[kind] // max(nbytes, 1))))
    if kind == "gpu" and (l2 := gpu_l2_bytes(device)):
        count = min(count, max(_GPU_MIN_SETS, math.ceil(_GPU_CACHE_COVER * l2 / max(nbytes, 1))))
    filters = _bytes(s for s in signature.operands if s.name == "w")
    if (kind == "cpu" and filters >= _CPU_COLD_FILTERS and
            math.prod(signature.output_shape) <= _CPU_COLD_PIXELS * signature.conv.out_channels):
        count = max(count, min(_MAX_SETS, -(-_CPU_CACHE_BYTES // filters)))
    if kind == "cpu":
        bound = _CPU_POINTWISE_BYTES if signature.conv is None else _CPU_CONV_BYTES
        count = max(count, min(_CPU_SETS, bound // max(nbytes, 1)))
    return count


def sets_bytes(signature: PlanSignature, device: Any) -> int:
    """The device memory :func:`random_operands` takes for :func:`set_count` sets."""
    one = _bytes(signature.operands[:-1])  # (the scalars come last)
    return set_count(signature, device) * one


def _bytes(specs: Iterable[Any]) -> int:
    """The bytes of arrays of `specs` (anything with a shape and a dtype)."""
    return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in specs)


def random_operands(signature: PlanSignature, device: Any, sets: int,
                    seed: int = 0) -> list[tuple[jax.Array, ...]]:
    """`sets` tuples of random operands of `signature` on `device`, generated there, without
    the trailing scalars operand (see :data:`TIMING_SCALARS`).

    Values are those of real layers: inputs in [-1, 1), filters scaled by the fan-in, batch-norm
    scales near 1 and variances in [0.5, 2), so every activation mode computes finite results.
    """
    rng = np.random.default_rng(seed)
    draws = _operand_draws(signature, device)
    out = []
    for index in range(sets):
        operands = []
        for number, (spec, (lo, hi), on_device) in enumerate(draws):
            if on_device:
                stream = jax.device_put(np.uint32(_mix(seed, index, number)), device)
                operands.append(_device_uniform(stream, spec.shape, spec.dtype.name, lo, hi))
            else:
                value = (rng.random(spec.shape, np.float32) * (hi - lo) + lo).astype(spec.dtype)
                operands.append(jax.device_put(value, device))
        out.append(tuple(operands))
    return out


def operand_shapes(signature: PlanSignature, device: Any, sets: int
                   ) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
    """The shapes, dtypes and placement of what :func:`random_operands` gives: enough to
    compile a timing program (:meth:`Harness.compile`) before the sets are drawn."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    one = tuple(jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
                for spec, _, _ in _operand_draws(signature, device))
    return [one] * sets


def compile_helper_programs(signature: PlanSignature, device: Any) -> None:
    """Compiles, without running anything, the device programs that :func:`random_operands`
    and :func:`relative_error` will run for `signature` on `device`: the host's share of
    drawing the sets and comparing outputs (XLA's compiles: 0.1-0.25 s at batch 256 on an
    H200, 2026-12-07), done where it holds no device that a measurement waits for."""
    if _platform_kind(device) == "cpu":
        return
    sharding = jax.sharding.SingleDeviceSharding(device)
    stream = jax.ShapeDtypeStruct((), jnp.uint32, sharding=sharding)
    for spec, (lo, hi), on_device in _operand_draws(signature, device):
        if on_device:
            _device_uniform.lower(stream, spec.shape, spec.dtype.name, lo, hi).compile()
    output = jax.ShapeDtypeStruct(signature.output_shape, signature.dtype, sharding=sharding)
    _device_error_terms.lower(output, output).compile()


def _operand_draws(signature: PlanSignature, device: Any
                   ) -> list[tuple[Any, tuple[float, float], bool]]:
    """For each operand but the scalars: its spec, its values' range, and whether it is drawn
    on the device (large, on a GPU) rather than on the host."""
    fan_in = 1
    if signature.conv is not None:
        fan_in = math.prod(signature.filter_shape) // signature.conv.out_channels
    ranges = {"x": (-1.0, 1.0), "side": (-1.0, 1.0), "bias": (-1.0, 1.0),
              "w": (-fan_in ** -0.5, fan_in ** -0.5), "scale": (0.5, 1.5),
              "shift": (-1.0, 1.0), "mean": (-0.5, 0.5), "var": (0.5, 2.0)}
    on_host = _platform_kind(device) == "cpu"
    return [(spec, ranges[spec.name],
             not on_host and math.prod(spec.shape) > _HOST_RANDOM_ELEMENTS)
            for spec in signature.operands[:-1]]  # (the scalars come last)


def _mix(*words: int) -> int:
    """A 32-bit stream number for `words` (seed, set, operand): distinct streams."""
    h = 0x811C9DC5
    for word in words:
        h = ((h ^ (word & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    return h


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _device_uniform(stream: jax.Array, shape: tuple[int, ...], dtype: str, lo: float,
                    hi: float) -> jax.Array:
    """Values in [lo, hi) hashed from each element's index and `stream` (on the device
    `stream` is on). Not jax.random: its threefry program took XLA 0.7-1.6 s to compile for
    each new shape of a plan's operands on an H100 (2026-12-07, batch 256), about half of a
    cold selection; this one is a few integer operations per element."""
    x = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) * jnp.uint32(0x9E3779B9) + stream
    # (a 32-bit finalizer: every bit of the index reaches every bit of the result)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    unit = (x >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)  # [0, 1) in float32 steps
    return (unit * jnp.float32(hi - lo) + jnp.float32(lo)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per run of a candidate: the device's work and, on GPUs, the host's (launching
    it). A model runs its layers' host and device work side by side, so the longer one is what
    a layer adds: device time for large problems, launch work for tiny ones (:attr:`cost`)."""

    device: float
    host: float = 0.0
    # Only the first (untimed) run's wall time: it already exceeded the caller's limit.
    cut_short: bool = False

    @property
    def cost(self) -> float:
        return max(self.device, self.host)


@dataclasses.dataclass
class Harness:
    """One candidate compiled into the timing program, for one list of input sets.

    On GPUs the program marks its start and end with a device stopwatch (the
    ``jaxfuse_stopwatch`` custom call), so a run is timed on the device, from a start the
    device reaches only once the host has queued the whole program; the host's time between
    the marks is its launch work. On CPUs the wall time of awaited calls is the measure.
    """

    run_all: Any  # the compiled program: input sets -> (one output per set, stopwatch token)
    sets: Sequence[tuple[jax.Array, ...]]
    platform: str
    stopwatch: int | None = None

    @classmethod
    def compile(cls, fn: Callable[..., jax.Array], sets: Sequence[tuple[Any, ...]],
                device: Any, sequential: bool = False) -> Harness:
        """Compiles ``[fn(*s, TIMING_SCALARS) for s in sets]`` as one program (raises if `fn`
        cannot). `sets` may be their shapes alone (:func:`operand_shapes`): assign the drawn
        sets to :attr:`sets` before running it. `sequential` (CPUs): each set's op starts once
        the one before has ended, as a network's layers run, not side by side as XLA may
        schedule independent ops."""
        platform = _platform_kind(device)
        stopwatch = _new_stopwatch(device) if platform == "gpu" else None

        def program(many: list[tuple[jax.Array, ...]]) -> Any:
            if stopwatch is None:
                outs: list[jax.Array] = []
                for s in many:
                    if outs and sequential:  # this set's operands wait for the last output
                        outs[-1], s = lax.optimization_barrier((outs[-1], s))
                    outs.append(fn(*s, TIMING_SCALARS))
                return outs, None
            start = _mark(stopwatch, 0)
            # Every candidate op waits for the start mark: nothing of theirs runs before it.
            start, many = lax.optimization_barrier((start, many))
            outs = [fn(*s, TIMING_SCALARS) for s in many]
            return outs, _mark(stopwatch, 1, start, *outs)

        try:
            compiled = jax.jit(program).lower(list(sets)).compile()
        except Exception:
            _delete_stopwatch(stopwatch)
            raise
        harness = cls(compiled, sets, platform, stopwatch)
        if stopwatch is not None:  # its events go with the harness (at exit too)
            weakref.finalize(harness, _delete_stopwatch, stopwatch)
        return harness

    def load(self) -> jax.Array:
        """One untimed run, ahead of :meth:`run`: loads the program's kernels (libraries load
        them lazily; cuDNN builds its plans on first use) and allocates its buffers. Returns
        the result on the first input set."""
        if self.stopwatch is not None:
            extension().stopwatch_gate(self.stopwatch, False)
        return jax.block_until_ready(self.run_all(list(self.sets)))[0][0]

    def run(self, limit: float | None = None, warm_up: float = _GPU_WARM_SECONDS
            ) -> tuple[jax.Array, Timing]:
        """The candidate's result on the first input set (to check candidates agree), and its
        times per run (see the class docstring). The first run, which also loads modules and
        allocates, is not timed; with a `limit`, a second run is timed (by the wall clock on
        CPUs, by the stopwatch's marks on GPUs), and if it already exceeds `limit` seconds per
        run (a candidate far slower than another), that is the result (``cut_short``): a
        loser needs no precise time, and a slow one costs seconds. On GPUs the timed runs
        follow `warm_up` seconds of untimed ones (:data:`_GPU_WARM_SECONDS`, or less where
        the device has just been busy).

        On GPUs timed runs keep the outputs of up to :data:`_KEPT_RUNS` runs before them
        alive, as a model's caller does with the results of calls queued back to back: each run then
        writes to new addresses, and a GPU program pays what that costs the host. XLA updates
        its command buffer, and every command it recorded by tracing a library call (cuDNN's
        convolutions, custom calls) misses its trace cache, which is keyed by buffer addresses
        and holds 16 entries, and is captured again. With outputs freed at once every run
        reused one address and hit the cache: on an H100 (2026-11-25) a batch-8 ResNet-50
        chain on cuDNN timed 34 us of launch work alone, while plain ``jax.jit`` of the
        network took 48 us of wall time per chain (2.53 ms for 53 chains, 0.78 ms of device
        time), and a program choice trusting the first number kept ten chains on XLA at half
        the forced-fused speed."""
        sets = list(self.sets)
        # The first run loads kernels (lazily, which may wait for the device) and allocates:
        # ungated, or the host would wait on the device the gate holds.
        if self.stopwatch is not None:
            extension().stopwatch_gate(self.stopwatch, False)
        first = jax.block_until_ready(self.run_all(sets))[0][0]
        if limit is not None:
            seconds = self._screening_seconds(sets, limit)
            if limit < seconds < math.inf:
                # Its launch work is unknown: charged the whole time, so no program picks it.
                return first, Timing(seconds, seconds, cut_short=True)
        if self.stopwatch is not None:  # (after screening: a loser is not warmed up)
            warm_until = time.perf_counter() + warm_up
            while time.perf_counter() < warm_until:
                jax.block_until_ready(self.run_all(sets))
            extension().stopwatch_gate(self.stopwatch, True)
        device: list[float] = []
        host: list[float] = []
        faults: list[int] = []  # CPUs: the process's page faults during each timed run
        kept = collections.deque(maxlen=_kept_runs(first, len(sets), self.platform))
        deadline = time.perf_counter() + _BUDGET_SECONDS[self.platform]
        while len(device) < self._min_runs(device) or (len(device) < _MAX_RUNS and
                                                       time.perf_counter() < deadline):
            faults_before = page_faults()
            start = time.perf_counter()
            kept.append(jax.block_until_ready(self.run_all(sets)))
            seconds = time.perf_counter() - start
            faults.append(page_faults() - faults_before)
            if self.stopwatch is not None:
                device_ms, host_ms, _, timed_out = extension().stopwatch_read(self.stopwatch)
                if timed_out:  # the host still waited for the device: time it ungated
                    extension().stopwatch_gate(self.stopwatch, False)
                    continue  # (and this run, which includes the wait, is not a sample)
                seconds = device_ms * 1e-3
                host.append(host_ms * 1e-3 / len(sets))
            device.append(seconds / len(sets))
        if self.stopwatch is None:
            # CPUs: the fastest quiet run. What slows a run on a shared CPU (another process,
            # the harness's own threads) only adds time; on a 2-core VM (2026-11-27) the
            # median of one window of XLA's batch-1 NA composition ranged 56-182 us from
            # window to window and the fastest runs agreed with the benchmark's.
            return first, Timing(min(quiet_runs(device, faults)))
        return first, Timing(statistics.median(device), statistics.median(host) if host else 0.0)

    def _min_runs(self, per_set: list[float]) -> int:
        """Timed runs to take at least, given those so far (seconds per set)."""
        if (self.platform == "gpu" and per_set and
                min(per_set) * len(self.sets) >= _LONG_RUN_SECONDS):
            return _MIN_RUNS_LONG
        return _MIN_RUNS[self.platform]

    def _screening_seconds(self, sets: list[tuple[jax.Array, ...]], limit: float) -> float:
        """Seconds per set of the fastest of a few runs after the first, stopping at one
        within `limit`; math.inf where no run is evidence.

        Not the first run: on an H100 the first run of an fp32 1x1 layer's fused candidate at
        batch 64 took 1.16 ms per set (loading, allocating) for a kernel of 0.19 ms, 4.8x XLA's
        time, and a winner was cut short. Nor one run alone: in a MobileNetV2's selection (H100,
        2026-11-25) single runs of batch-1 candidates whose kernels take microseconds took
        1.5-2 ms per set by the wall clock. On CPUs a run that faulted its output's pages in
        is no evidence either (:func:`quiet_runs`): on a 2-core VM (2026-11-26) every other run
        of a batch-8 NA program took 3136 faults (its 12.8 MB output) and 3x its quiet time,
        both screening runs of the fused kernel fell on such runs, and a kernel 2.6x faster
        than XLA's composition was cut short at 6.3 ms a run. On GPUs a run is the longer of
        the stopwatch's device and host times between the program's marks, which leave out
        the host's work before and after the program (XLA allocating its buffers, the wait for
        the result): on an H100 (2026-11-27) ResNet-50's fp32 1x1 64->256 chain with a side
        input at batch 64 (185 us of kernel, 410 MB of output and side input a set) screened
        at 1.05 ms a set by the wall clock and was cut short against XLA's 310 us; by its
        marks the same runs take 190 us of device and 32 us of host time."""
        cpu = self.platform == "cpu"
        seconds = math.inf
        for _ in range(3 if cpu else 2):
            faults_before = page_faults()
            start = time.perf_counter()
            jax.block_until_ready(self.run_all(sets))
            elapsed = (time.perf_counter() - start) / len(sets)
            if self.stopwatch is not None:
                device_ms, host_ms, _, _ = extension().stopwatch_read(self.stopwatch)
                elapsed = max(device_ms, host_ms) * 1e-3 / len(sets)
            if not cpu or page_faults() - faults_before <= _FAULT_SLACK:
                seconds = min(seconds, elapsed)
            if seconds <= limit:
                break
        return seconds


# Page faults a run may take beyond the quietest run's and still count as quiet.
_FAULT_SLACK = 64


def quiet_runs(seconds: list[float], faults: list[int]) -> list[float]:
    """The times of the runs that took (about) the fewest page faults.

    On CPUs a run that finds its output's memory freshly returned to the system faults it in
    page by page: on a 2-core VM (2026-11-26) a batch-8 NA kernel's run took 3170 minor faults
    and 4.4 ms instead of none and 1.0 ms, for whole measurement windows at a time, depending
    on the allocator's state (the harness's thread, which runs came before), not on the
    candidate; either candidate was hit, and the find step kept XLA's 2.6 ms op. The faulting
    runs are set aside while quieter ones exist."""
    if not faults or len(faults) != len(seconds):
        return seconds
    least = min(faults)
    return [s for s, f in zip(seconds, faults) if f <= least + _FAULT_SLACK]


def page_faults() -> int:
    """The process's minor page faults so far (0 where the platform cannot tell)."""
    if sys.platform == "win32":
        return 0
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _kept_runs(first: jax.Array, sets: int, platform: str) -> int:
    """How many earlier runs' outputs :meth:`Harness.run` keeps alive: on GPUs as many as fit
    :data:`_KEPT_BYTES` beside the running one's; none on CPUs, which have no command buffers
    and would only fault in fresh pages."""
    if platform != "gpu":
        return 0
    run_bytes = max(first.nbytes * sets, 1)
    return int(max(0, min(_KEPT_RUNS, _KEPT_BYTES // run_bytes - 1)))


def _new_stopwatch(device: Any) -> int:
    return extension().stopwatch_new(gpu_platform(device), gpu_ordinal(device))


def _delete_stopwatch(stopwatch: int | None) -> None:
    if stopwatch is not None:
        extension().stopwatch_delete(stopwatch)


def _mark(stopwatch: int, mark: int, *after: jax.Array) -> jax.Array:
    """The stopwatch's `mark` (0 start, 1 end), recorded once every array in `after` is."""
    token = jax.ShapeDtypeStruct((1,), jnp.float32)
    return jax.ffi.ffi_call(STOPWATCH_TARGET, token, has_side_effect=True)(
        *after, stopwatch=np.int64(stopwatch), mark=np.int64(mark))


def relative_error(a: jax.Array, b: jax.Array) -> float:
    """``|a - b| / |b|`` in float32 (inf when either has a non-finite value where the other
    does not): on the host for CPU arrays, on the device otherwise."""
    if all(d.platform == "cpu" for d in a.devices()):
        diff, ref, mismatched = _error_terms(np.asarray(a, np.float32),
                                             np.asarray(b, np.float32), np)
    else:
        diff, ref, mismatched = (np.asarray(v) for v in _device_error_terms(a, b))
    if int(mismatched):
        return math.inf
    return math.sqrt(float(diff)) / max(math.sqrt(float(ref)), 1e-30)


def _error_terms(a: Any, b: Any, xp: Any) -> tuple[Any, Any, Any]:
    """(|a - b|^2, |b|^2 where both are finite, and how many elements are finite in one of a
    and b only), with NumPy or jnp: three sums over the same elements, which XLA reduces in
    one pass (one kernel to compile for each new shape)."""
    a32, b32 = a.astype(xp.float32), b.astype(xp.float32)
    finite_a, finite_b = xp.isfinite(a32), xp.isfinite(b32)
    both = finite_a & finite_b
    diff = xp.where(both, a32 - b32, 0.0)
    ref = xp.where(both, b32, 0.0)
    return (xp.sum(diff * diff, dtype=xp.float32), xp.sum(ref * ref, dtype=xp.float32),
            xp.sum(finite_a != finite_b, dtype=xp.int32))


_device_error_terms = jax.jit(lambda a, b: _error_terms(a, b, jnp))
