"""Choosing a plan's solver by measurement: MIOpen's find step, cuDNN's autotuning.

For a signature on a device, :func:`choose` times jaxfuse's fused kernel and XLA's unfused
composition in one harness (:mod:`jaxfuse.measure`) on random inputs of the plan's shapes,
checks that they agree, and keeps the faster (by the longer of device time and launch work, or
by device time alone where the fused kernel is device-bound). The fused kernel must win by a
margin (:func:`margin`), since a tie is noise and XLA's composition may fuse with its
neighbours in a whole program. A candidate that fails (compiles, runs, or disagrees with the
other) is dropped and the reason kept; XLA's composition runs wherever jax does, so a plan
always has a solver.

Decisions are memoized in memory by the caller (:mod:`jaxfuse.compiled`) and here on disk, in
the kernel cache (``$JAXFUSE_CACHE_DIR/kernels``, with its directory checks and per-entry
verification), keyed by everything that can change the outcome: the device kind (on CPUs the
processor and its threads), jax, jaxlib, the jax plugins and NVIDIA/ROCm wheels, jaxfuse and its
kernel sources, ``XLA_FLAGS`` and ``JAXFUSE_*`` settings, the fused kernel's tile and the plan.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.metadata
import itertools
import json
import logging
import math
import os
import pathlib
import platform as platform_module
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jaxlib

from ._extension import extension
from .measure import (
    GPU_REWARM_SECONDS,
    Harness,
    compile_helper_programs,
    device_timing,
    holds_device_timing,
    operand_shapes,
    random_operands,
    relative_error,
    set_count,
    sets_bytes,
)
from .signature import PlanSignature
from .solvers import XLA, FusedKernel, fused_function, xla_function

__all__ = ["CPU_MARGIN", "CPU_POINTWISE_MARGIN", "MARGIN", "Decision", "Trial", "choose",
           "compile_ahead", "fastest_form", "margin", "stats"]

logger = logging.getLogger("jaxfuse")

FUSED = "fused"
# The fused kernel runs a plan only when it costs at most (1 - margin) of XLA's composition:
# MARGIN on GPUs, CPU_MARGIN on CPUs, whose timings of one program spread wider. On a 2-core
# VM (2026-11-26) the find step and the layer benchmark disagreed by about 10% about batch-1
# NA kernels at parity with XLA's composition (80-160 us ops), and the find step's pick ran
# 0.89x XLA in the benchmark; a kernel that wins on a CPU wins by far more (1.2-14x a model).
MARGIN = 0.03
CPU_MARGIN = 0.10
# CPU plans without a convolution: a loop over the tensor on either side, both bound by memory
# at batch 1 and 8 where they are at par (fp32, fp16), and one side's runs spread by 10-20%
# from window to window on the 2-core VM (2026-11-27); where the fused kernel wins it wins by
# far more (NCHW planes 1.2-1.7x, bfloat16 2-12x).
CPU_POINTWISE_MARGIN = 0.20


def margin(platform: str, pointwise: bool = False) -> float:
    """How much faster than XLA's composition the fused kernel must measure on `platform`
    (`pointwise`: a plan without a convolution)."""
    if platform.lower() != "cpu":
        return MARGIN
    return CPU_POINTWISE_MARGIN if pointwise else CPU_MARGIN

# CPUs: windows after the first of each candidate, while their times are within _CPU_CLOSE of
# each other and for at most _CPU_WINDOWS_SECONDS. On a 2-core VM (2026-11-27) two windows each
# kept the fused kernel for 2 of 3 batch-1 NA chains the benchmark timed 6-17% faster on XLA in
# two of three fresh processes; with the fastest run of up to five windows each, 1 in 9.
_CPU_WINDOWS = 4
_CPU_CLOSE = 1.5
_CPU_WINDOWS_SECONDS = 1.0
# GPUs: one more window of each candidate, in the other order, while they are within
# _GPU_CLOSE of each other; each keeps its lower device and launch times. On four H200s
# (2026-11-28) one window each, XLA's first, kept the fused kernel for ResNet-50's last 1x1
# chain (bf16 and fp16 NCHW, batch 64), which the benchmark then timed at 0.96-0.97x XLA:
# by the find step XLA's composition was at least 10% slower than by the benchmark.
_GPU_CLOSE = 1.25

# A fused kernel whose second run (the first loads and allocates) takes this many times XLA's
# measured cost, and at least _GIVE_UP_FLOOR seconds per run, is not timed further: the direct
# fp32 kernel at batch 64 takes tens of milliseconds a run.
_GIVE_UP = 3.0
_GIVE_UP_FLOOR = 1e-3
# How far the fused result may be from XLA's (norm-relative) before it counts as wrong: XLA
# itself runs float32 convolutions in TF32 and rounds between the unfused steps.
_TOLERANCE = {"float32": 1e-2, "float16": 2e-2, "bfloat16": 4e-2}

_lock = threading.Lock()
_stats = {"measured": 0, "disk_hits": 0}
# One thread runs every measurement: it carries no jax trace (plans compile while a caller's
# function is being traced, where jax ops would be staged instead of run), and measurements
# never overlap.
_WORKER_NAME = "jaxfuse-find"
_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=_WORKER_NAME)
# ... and one compiles, beside it, what drawing the sets and comparing outputs will run.
_helper_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxfuse-helpers")


# The input sets on the device, in bytes, by open trial (Trial.sets). compile_ahead draws a
# plan's sets ahead of its measurement only while every open trial's together stay within
# _AHEAD_BYTES (or no other trial holds any): plans compiled together (a network's, by
# jaxfuse.rewrite) would otherwise each hold theirs, up to _SET_BUDGET's 256 MB a plan, from
# their XLA candidate's compile to the end of their own compile. A plan refused draws them at
# its measurement, on the same thread: the find step's work is the same, in another order.
_AHEAD_BYTES = 512 << 20
_resident_lock = threading.Lock()
_resident: dict[int, int] = {}
_trial_numbers = itertools.count()


def _release(number: int) -> None:
    with _resident_lock:
        _resident.pop(number, None)


def _may_draw_ahead(signature: PlanSignature, device: Any, trial: Trial) -> bool:
    """Whether compile_ahead may draw `trial`'s sets now (see _AHEAD_BYTES)."""
    with _resident_lock:
        if trial.closed:
            return False
        others = sum(nbytes for number, nbytes in _resident.items() if number != trial._number)
    return others == 0 or others + sets_bytes(signature, device) <= _AHEAD_BYTES


# What reading a malformed disk record may raise (its checksum only says jaxfuse wrote it).
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError,
              OverflowError, RecursionError)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which solver runs a signature on a device, and the evidence.

    Attributes:
      solver: ``"fused"`` or ``"xla"``.
      times_us: measured cost in microseconds per run, by candidate (``"fused"``, ``"xla"``):
        the longer of device time and the host's launch work (:class:`~jaxfuse.measure.Timing`);
        where the fused kernel is device-bound the choice compares device times (`_faster`).
      failures: why a candidate was dropped, by candidate.
      origin: ``"measured"`` now, or ``"disk cache"``.
      device_us, host_us: the two parts of `times_us` per run, by candidate (GPUs): device
        time and the host's launch work; a whole program weighs them together (its host
        runs ahead of its device), see :mod:`jaxfuse.rewrite.choice`.
    """

    solver: str
    times_us: tuple[tuple[str, float], ...] = ()
    failures: tuple[tuple[str, str], ...] = ()
    origin: str = "measured"
    device_us: tuple[tuple[str, float], ...] = ()
    host_us: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({"solver": self.solver, "times_us": dict(self.times_us),
                           "failures": dict(self.failures), "device_us": dict(self.device_us),
                           "host_us": dict(self.host_us)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Decision | None:
        """The decision stored in `data`, or None for anything malformed."""
        try:
            raw = json.loads(data.decode())
            solver = raw["solver"]
            times = tuple((str(k), float(v)) for k, v in raw["times_us"].items())
            failures = tuple((str(k), str(v)) for k, v in raw["failures"].items())
            device = tuple((str(k), float(v)) for k, v in raw.get("device_us", {}).items())
            host = tuple((str(k), float(v)) for k, v in raw.get("host_us", {}).items())
        except _MALFORMED:
            return None
        names = [k for part in (times, failures, device, host) for k, _ in part]
        if (solver not in (FUSED, XLA) or any(k not in (FUSED, XLA) for k in names)
                or not all(math.isfinite(v) for part in (times, device, host) for _, v in part)):
            return None
        return cls(solver, times, failures, origin="disk cache", device_us=device, host_us=host)


class Trial:
    """What one plan's selection measures with: the random input sets, drawn once, and each
    candidate's compiled harness on them (XLA's composition and every form of the fused
    kernel), shared by :func:`compile_ahead`, :func:`fastest_form` and :func:`choose`.

    Timing the forms and then the fastest form against XLA's composition would otherwise draw
    the sets and compile that form's timing program twice. A trial lives as long as one plan's
    compile (:func:`jaxfuse.compiled.compile_signature`), which closes it (:meth:`close`) when
    it ends: work queued for it and not yet done is dropped, so the sets' memory goes with it.
    """

    def __init__(self) -> None:
        self._sets: list[tuple[Any, ...]] | None = None
        self._harnesses: dict[str, Harness] = {}  # by candidate: XLA or a form's label
        self._shaped: set[str] = set()  # candidates compiled on the sets' shapes, not yet run
        self.ahead_seconds: float | None = None  # what compile_ahead took, once it ran
        self._ahead: concurrent.futures.Future | None = None  # compile_ahead's task
        self._number = next(_trial_numbers)  # (its key among the trials holding sets)
        self.closed = False

    def close(self) -> None:
        """Ends the trial: compile_ahead's task is cancelled if it has not started, and stops
        at its next step if it has (it holds the trial until then)."""
        with _resident_lock:
            self.closed = True
            _resident.pop(self._number, None)
        if self._ahead is not None:
            self._ahead.cancel()

    def sets(self, signature: PlanSignature, device: Any) -> list[tuple[Any, ...]]:
        """The input sets for `signature` on `device` (raises as random_operands does)."""
        if self._sets is None:
            self._sets = random_operands(signature, device, set_count(signature, device))
            with _resident_lock:
                if not self.closed:
                    _resident[self._number] = sets_bytes(signature, device)
                    weakref.finalize(self, _release, self._number)
        return self._sets

    def harness(self, candidate: str, fn: Callable[..., Any], signature: PlanSignature,
                device: Any, shapes_only: bool = False) -> Harness:
        """The harness kept for `candidate`, else `fn`'s timing program on the sets, compiled
        now and kept; a plan without a convolution times its sets in sequence
        (measure.set_count). With `shapes_only`, and no sets drawn yet, it compiles on their
        shapes, and the sets are drawn when the harness is next asked for without it."""
        harness = self._harnesses.get(candidate)
        if harness is None:
            shaped = shapes_only and self._sets is None
            sets = (operand_shapes(signature, device, set_count(signature, device)) if shaped
                    else self.sets(signature, device))
            harness = Harness.compile(fn, sets, device, sequential=signature.conv is None)
            self._harnesses[candidate] = harness
            if shaped:
                self._shaped.add(candidate)
        if not shapes_only and candidate in self._shaped:
            harness.sets = self.sets(signature, device)
            self._shaped.discard(candidate)
        return harness


def compile_ahead(signature: PlanSignature, device: Any, trial: Trial) -> None:
    """Starts compiling XLA's candidate for `signature` (and loading its kernels) on the find
    step's thread, into `trial`, while the caller compiles the fused kernel: on GPUs, where a
    signature not measured before on this device will be (its decision is then on disk).
    XLA's candidate compiles on the input sets' shapes, while the programs that draw them
    and compare the candidates' outputs compile beside it, holding nothing
    (measure.compile_helper_programs); then the sets are drawn and the candidate loaded,
    where the sets of the plans being compiled fit _AHEAD_BYTES (else its measurement does it).

    XLA's compile of a convolution at batch 256 autotunes cuDNN's algorithms on the device:
    0.3-0.7 s for ResNet-50's chains and 0.9-2.4 s for MobileNetV2's depthwise ones on an H100
    (2026-12-07), most of a cold choice; beside the fused kernel's runtime compiles (seconds
    at that size) it costs the selection only what it outlasts them by. It holds the device
    while it autotunes, as every measurement does; the kernel's autotuner then waits for it,
    and the plan reports that wait (:func:`jaxfuse.compiled.compile_signature`'s "waited")."""
    if not _compiles_ahead(device) or any(d == 0 for d in signature.output_shape):
        return
    if extension().cache_load(_measured_key(signature, device)) is not None:
        return
    trial._ahead = _worker.submit(_compile_xla_ahead, signature, device, trial)


def _compiles_ahead(device: Any) -> bool:
    """Whether compile_ahead runs on `device`'s platform: GPUs (a CPU's kernel step is quick,
    leaving nothing to overlap), which are also the only readers of _mark_measured's records."""
    return device.platform.lower() != "cpu"


def _compile_xla_ahead(signature: PlanSignature, device: Any, trial: Trial) -> None:
    if trial.closed:  # (its plan's compile ended before this task started)
        return
    start = time.perf_counter()
    # The programs that draw the sets and compare the outputs compile beside XLA's candidate,
    # holding nothing (0.1-0.46 s a plan for MobileNetV2 at batch 256 on an H100, 2026-12-07,
    # once part of this step's wall time); XLA's candidate compiles on the sets' shapes.
    helpers = _helper_worker.submit(compile_helper_programs, signature, device)
    try:
        fn = xla_function(signature)
        with device_timing():  # (XLA's autotuning runs on the device)
            trial.harness(XLA, fn, signature, device, shapes_only=True)
        concurrent.futures.wait([helpers])  # (the sets are drawn with what they compile)
        if _may_draw_ahead(signature, device, trial):
            with device_timing():
                trial.harness(XLA, fn, signature, device).load()
    except Exception as err:  # (the choice compiles it again, and reports what fails)
        logger.debug("jaxfuse: %s: XLA's candidate not compiled ahead: %s",
                     signature.describe(), err)
    finally:  # (never left running into the choice, which would compile them again)
        _await_helpers(helpers, signature)
    trial.ahead_seconds = time.perf_counter() - start


def _await_helpers(helpers: concurrent.futures.Future, signature: PlanSignature) -> None:
    """Waits for the helper programs' compiles; a failure is logged (drawing the sets or
    comparing the outputs then compiles them again, and reports what fails)."""
    error = helpers.exception()
    if error is not None:
        logger.debug("jaxfuse: %s: the helper programs did not compile ahead: %s",
                     signature.describe(), error)


def _measured_key(signature: PlanSignature, device: Any) -> str:
    """The disk cache's record that `signature` was measured on `device` (whatever kernel
    the fused candidate was), which :func:`compile_ahead` reads."""
    platform = device.platform.lower()
    environment = _environment_key(device.device_kind, platform)
    # (with the decisions' version: a record of an older rule's decision says nothing)
    return (f"jaxfuse-measured-v1|decisions v{_decision_version(platform)}|{environment}|"
            f"{signature.encode()}")


def stats() -> dict[str, int]:
    """Counts of measurements made and decisions read from disk in this process."""
    with _lock:
        return dict(_stats)


def choose(signature: PlanSignature, device: Any, fused: FusedKernel,
           trial: Trial | None = None) -> Decision:
    """The faster of `fused` (prepared on `device`) and XLA for `signature`: from the disk
    cache when this exact setting was measured before, else measured now (with `trial`'s
    input sets and harnesses, where :func:`fastest_form` left them)."""
    key = _disk_key(signature, device, fused)
    stored = extension().cache_load(key)
    decision = None if stored is None else Decision.from_json(stored)
    if decision is not None:
        # The times are the record; the rule (the margin) is this version's.
        decision = dataclasses.replace(
            decision, solver=_faster(dict(decision.times_us), dict(decision.failures),
                                     device.platform, dict(decision.device_us),
                                     dict(decision.host_us),
                                     pointwise=signature.conv is None))
        with _lock:
            _stats["disk_hits"] += 1
        _mark_measured(signature, device)
        return decision
    decision = _on_find_thread(_measure, signature, device, fused, trial)
    with _lock:
        _stats["measured"] += 1
    if len(decision.times_us) == 2:  # a failure may be passing (memory): measure it again
        extension().cache_store(key, decision.to_json())
        _mark_measured(signature, device)
    logger.debug("jaxfuse: %s on %s -> %s (%s)", signature.describe(), device.device_kind,
                 decision.solver, decision)
    return decision


def _on_find_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run on the find step's thread, which takes the device-timing lock: from a
    thread holding that lock, or from the find step's own, it would wait forever."""
    if holds_device_timing() or threading.current_thread().name.startswith(_WORKER_NAME):
        raise RuntimeError(
            "jaxfuse: a plan in solver mode 'auto' is measured on the find step's thread, "
            "which this thread blocks (it holds the device-timing lock, or is that thread): "
            "compile the plan before taking the lock (jaxfuse.measure.device_timing)")
    return _worker.submit(fn, *args).result()


def _mark_measured(signature: PlanSignature, device: Any) -> None:
    """Records that `signature`'s decision on `device` is on disk, for compile_ahead."""
    if not _compiles_ahead(device):
        return
    key = _measured_key(signature, device)
    if extension().cache_load(key) is None:
        extension().cache_store(key, b"1")


def _measure(signature: PlanSignature, device: Any, kernel: FusedKernel,
             trial: Trial | None = None) -> Decision:
    trial = trial or Trial()
    times: dict[str, float] = {}
    device_us: dict[str, float] = {}
    host_us: dict[str, float] = {}
    failures: dict[str, str] = {}
    # Without a convolution (CPUs): sets timed in sequence, a wider margin (measure.set_count).
    pointwise = signature.conv is None
    if any(d == 0 for d in signature.output_shape):
        return Decision(FUSED, failures=((XLA, "not measured: the output is empty"),))
    with device_timing():
        try:
            trial.sets(signature, device)  # (first: without them nothing is measured)
        except Exception as err:
            return Decision(FUSED, failures=((XLA, f"not measured: {_first_line(err)}"),))
        outputs: dict[str, Any] = {}
        harnesses: dict[str, Harness] = {}
        # XLA first: a fused kernel already _GIVE_UP times slower is not timed further.
        fused = functools.partial(fused_function, filters=kernel.filters,
                                  layout=kernel.input_layout)
        for name, make in ((XLA, xla_function), (FUSED, fused)):
            limit = (give_up_limit(times[XLA] * 1e-6)
                     if name == FUSED and XLA in times else None)
            try:
                # (compiled ahead, or by the forms' timing, where they ran)
                harness = trial.harness(XLA if name == XLA else kernel.label,
                                        make(signature), signature, device)
                outputs[name], timing = harness.run(limit)
                times[name] = timing.cost * 1e6
                if timing.host or timing.cut_short:
                    device_us[name], host_us[name] = timing.device * 1e6, timing.host * 1e6
                if not timing.cut_short:
                    harnesses[name] = harness
            except Exception as err:
                failures[name] = _first_line(err)
                logger.debug("jaxfuse: %s candidate %s failed: %s", signature.describe(), name,
                             err)
        if FUSED in outputs and XLA in outputs:
            wrong = _disagreement(outputs[FUSED], outputs[XLA], signature, "XLA")
            if wrong is not None:
                failures[FUSED] = wrong
                logger.warning("jaxfuse: the fused kernel for %s %s; XLA runs it",
                               signature.describe(), wrong)
                times.pop(FUSED, None)
        if len(harnesses) == 2 and FUSED not in failures:
            _more_windows(harnesses, times, device_us, host_us, signature,
                          gpu=device.platform.lower() != "cpu")
    for name in failures:  # a failed candidate is no candidate, for a program either
        device_us.pop(name, None), host_us.pop(name, None)
    return Decision(_faster(times, failures, device.platform, device_us, host_us,
                            pointwise=pointwise),
                    tuple(times.items()),
                    tuple(failures.items()),
                    device_us=tuple(device_us.items()), host_us=tuple(host_us.items()))


def _more_windows(harnesses: dict[str, Harness], times: dict[str, float],
                  device_us: dict[str, float], host_us: dict[str, float],
                  signature: PlanSignature, gpu: bool) -> None:
    """More windows of both candidates, in turns, each keeping its fastest (noise only adds
    time), while the two are close: a wider gap no window's noise reverses.

    CPUs: up to _CPU_WINDOWS while time is left. A window's runs can all take page faults for
    their outputs (the allocator's state, measure.quiet_runs) or share the cores with other
    work, which then weighs on whichever candidate it fell on. GPUs: one more, fused kernel
    first, so that neither candidate is timed only first (see _GPU_CLOSE)."""
    close, windows = (_GPU_CLOSE, 1) if gpu else (_CPU_CLOSE, _CPU_WINDOWS)
    deadline = time.perf_counter() + _CPU_WINDOWS_SECONDS
    for turn in range(windows):
        # (the CPU's second window runs whatever the first gave; closeness is judged on the
        # times _faster will compare)
        basis = _compared(times, device_us, host_us)
        if (turn or gpu) and max(basis.values()) > close * min(basis.values()):
            return
        if turn and time.perf_counter() > deadline:
            return
        for name in (FUSED, XLA) if turn % 2 == 0 else (XLA, FUSED):
            try:
                # (a short warm-up: the device ran the other candidate just before, but sat
                # idle while the host compared their outputs)
                timing = harnesses[name].run(warm_up=GPU_REWARM_SECONDS)[1]
            except Exception as err:  # it ran once: keep that time
                logger.debug("jaxfuse: %s candidate %s, window %d: %s", signature.describe(),
                             name, turn + 2, err)
                continue
            if name in device_us:
                device_us[name] = min(device_us[name], timing.device * 1e6)
                host_us[name] = min(host_us[name], timing.host * 1e6)
                times[name] = max(device_us[name], host_us[name])
            else:
                times[name] = min(times[name], timing.cost * 1e6)


def fastest_form(signature: PlanSignature, device: Any, kernels: list[FusedKernel],
                 trial: Trial | None = None) -> FusedKernel:
    """The fastest of `kernels`, jaxfuse's kernels for `signature` in different forms
    (jaxfuse.solvers.prepare_forms), timed on `device` as :func:`choose` times candidates
    (transposes included; one window each); from the disk cache when measured before. A form
    that fails to run or disagrees with the first that ran is dropped; the first kernel (the
    plan's own form) is kept if every one fails. `trial` keeps the input sets and harnesses
    for :func:`choose`."""
    labels = [kernel.label for kernel in kernels]
    # v2: GPU forms timed after warm-up runs (measure._GPU_WARM_SECONDS)
    key = (f"jaxfuse-form-v2|{_environment_key(device.device_kind, device.platform.lower())}|"
           f"{'|'.join(labels)}|{signature.encode()}")
    stored = extension().cache_load(key)
    if stored is not None:
        try:
            return kernels[labels.index(json.loads(stored.decode())["fastest"])]
        except _MALFORMED:
            pass  # malformed: measure again
    times = _on_find_thread(_time_forms, signature, device, kernels, trial)
    logger.debug("jaxfuse: %s forms on %s: %s", signature.describe(), device.device_kind, times)
    if not times:
        return kernels[0]
    fastest = min(times, key=times.get)
    if len(times) == len(kernels):  # a failure may be passing (memory): measure it again
        extension().cache_store(key, json.dumps({"fastest": fastest, "times_us": times}).encode())
    return kernels[labels.index(fastest)]


def _time_forms(signature: PlanSignature, device: Any, kernels: list[FusedKernel],
                trial: Trial | None = None) -> dict[str, float]:
    """Microseconds per run of each form that runs and agrees with the first that ran."""
    trial = trial or Trial()
    times: dict[str, float] = {}
    reference = None
    with device_timing():
        try:
            trial.sets(signature, device)  # (first: without them no form is timed)
        except Exception as err:
            logger.debug("jaxfuse: %s forms not timed: %s", signature.describe(), err)
            return times
        for kernel in kernels:
            try:
                harness = trial.harness(
                    kernel.label, fused_function(signature, kernel.filters, kernel.input_layout),
                    signature, device)
                outputs, timing = harness.run()
            except Exception as err:
                logger.debug("jaxfuse: %s form %s failed: %s", signature.describe(),
                             kernel.label, err)
                continue
            if reference is None:
                reference = outputs
            elif (wrong := _disagreement(outputs, reference, signature, "the plan's own form")
                  ) is not None:
                logger.warning("jaxfuse: the %s form of %s %s; it is not used", kernel.label,
                               signature.describe(), wrong)
                continue
            times[kernel.label] = timing.cost * 1e6
    return times


def _disagreement(output: Any, reference: Any, signature: PlanSignature, whose: str
                  ) -> str | None:
    """Why `output` cannot stand in for `reference` (`whose` result), or None where the two
    agree within the dtype's tolerance. A comparison that fails (out of device memory, say)
    leaves `output` unchecked, which is no candidate either."""
    try:
        error = relative_error(output, reference)
    except Exception as err:
        return f"not compared with {whose}: {_first_line(err)}"
    if error <= _TOLERANCE[signature.dtype.name]:
        return None
    return f"disagrees with {whose} (relative error {error:.2e})"


def give_up_limit(xla_seconds: float) -> float:
    """Seconds per run past which the fused candidate is not timed further, given XLA's."""
    return max(xla_seconds * _GIVE_UP, _GIVE_UP_FLOOR)


def _faster(times: dict[str, float], failures: dict[str, str], platform: str,
            device_us: dict[str, float] | None = None,
            host_us: dict[str, float] | None = None, *, pointwise: bool = False) -> str:
    """The solver to run: the fused kernel where it beats XLA by :func:`margin` or XLA failed,
    XLA where it is close or the fused kernel failed (and the fused kernel when nothing was
    measured: its own errors then reach the caller).

    A candidate costs the longer of its device time and its launch work (`times`), except
    where the fused kernel is device-bound (its device time at least its launch work): then
    the two are compared on device time alone. A plan that big is not launch-bound in any
    program it runs in, whose other work hides the launches of either candidate; timed
    alone, XLA's composition of several kernels can be launch-bound and lose to a fused
    kernel that is slower on the device (H100, 2026-11-27: ResNet-50's last 1x1 chain, bf16
    NCHW batch 64, XLA 24.9 us device and 36.7 us of launches against 27.6 us fused).
    """
    working = {k: v for k, v in times.items() if k not in failures}
    if XLA not in working:
        return FUSED
    if FUSED not in working:
        return XLA
    working = _compared(working, device_us or {}, host_us or {})
    return FUSED if working[FUSED] <= (1 - margin(platform, pointwise)) * working[XLA] else XLA


def _compared(times: dict[str, float], device_us: dict[str, float],
              host_us: dict[str, float]) -> dict[str, float]:
    """What the choice compares (see _faster): the candidates' device times where both were
    split into device and launch work and the fused kernel is device-bound, else `times`."""
    if (all(k in device_us and k in host_us for k in (FUSED, XLA))
            and device_us[FUSED] >= host_us[FUSED]):
        return device_us
    return times


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _environment_key(device_kind: str, platform: str) -> str:
    """What, beside the plan, can change a measurement's outcome: the device, the software
    measuring (jax, jaxlib, the plugins and libraries XLA's kernels come from, jaxfuse and
    its kernel sources), ``XLA_FLAGS`` and jaxfuse's own settings (``JAXFUSE_*``, which pick
    kernels, instruction sets and launches); on CPUs the processor and its threads."""
    settings = sorted((name, value) for name, value in os.environ.items()
                      if name.startswith("JAXFUSE_") and name not in _UNKEYED_SETTINGS)
    digest = hashlib.sha256(json.dumps([os.environ.get("XLA_FLAGS", ""), settings]).encode())
    return f"{_software_key(device_kind, platform)}|settings {digest.hexdigest()[:12]}"


# Settings that change no measurement: where the cache lives, and which solver is forced.
_UNKEYED_SETTINGS = frozenset({"JAXFUSE_CACHE_DIR", "JAXFUSE_SOLVER"})


@functools.cache
def _software_key(device_kind: str, platform: str) -> str:
    ext = extension()
    sources = hashlib.sha256(
        json.dumps(sorted(ext.kernel_sources().items())).encode()).hexdigest()[:16]
    host = (f"{_processor()}, {os.cpu_count()} cpus, {ext.cpu_threads()} threads"
            if platform == "cpu" else f"libraries {_libraries()}")
    from . import __version__

    return (f"{platform}|{device_kind} {host}|jax {jax.__version__}|jaxlib "
            f"{jaxlib.__version__}|jaxfuse {__version__} kernels {sources}")


def _processor() -> str:
    """The CPU's model and a digest of its feature flags (which instruction sets the CPU
    kernels and XLA's use), where the system tells them."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform_module.processor() or platform_module.machine()
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:8]
    return f"{fields.get('model name', platform_module.machine())} flags {flags}"


def _libraries() -> str:
    """A digest of the installed jax plugins and the NVIDIA and ROCm wheels they load (cuDNN's
    among them), whose versions change XLA's kernels without jaxlib's changing."""
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm", "nvidia-", "rocm-")):
            found.append(f"{name} {dist.version}")
    return hashlib.sha256("|".join(sorted(found)).encode()).hexdigest()[:12]


def _disk_key(signature: PlanSignature, device: Any, fused: FusedKernel) -> str:
    platform = device.platform.lower()
    environment = _environment_key(device.device_kind, platform)
    # v9 (GPUs only): large plans timed on fewer sets, enough to cover the L2 cache 1.5 times
    # (measure.set_count).
    # v8 (GPUs only): closeness for the second window judged on the times the choice compares
    # (v7 judged it on the costs, so a device-bound fused kernel against XLA's long launches
    # rarely got one), and that window after 5 ms of warm-up. v7 (GPUs): candidates timed
    # after warm-up runs, and close ones in a second window in the other order (_GPU_CLOSE).
    # v6 (CPUs; GPUs skip it): CPU plans with a convolution timed on up to 8 sets while they
    # take at most 16 MB (measure.set_count).
    # v5: CPU plans without a convolution timed on 8 sets in sequence (measure.set_count).
    # v4: CPU screening runs that faulted are no evidence (measure.Harness._screening_seconds;
    # v3 cut fast CPU kernels short on them). v3: launch work timed with earlier outputs alive.
    return (f"jaxfuse-solver-v{_decision_version(platform)}|{environment}|{fused.label}|"
            f"{signature.encode()}")


def _decision_version(platform: str) -> int:
    """The version of the rules a stored decision was measured by (see _disk_key)."""
    return 6 if platform == "cpu" else 9
