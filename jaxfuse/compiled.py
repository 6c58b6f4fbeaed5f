"""Compiling plan signatures for a device, memoized per (platform, device, signature)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from typing import Any

import jax

from . import find
from ._extension import extension
from .errors import FusionError
from .primitive import checked_operands, fused_chain
from .signature import PlanSignature
from .solvers import (
    XLA,
    FusedKernel,
    form_operands,
    kernel_signature,
    prepare_forms,
    solver_mode,
    xla_function,
)

__all__ = ["CompiledPlan", "cache_info", "clear_cache", "compile_signature", "default_device"]

logger = logging.getLogger("jaxfuse")


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """A signature compiled for one device: the solver that runs it and why.

    The fused kernel itself lives in the extension's cache; the xla solver is a jax function.
    """

    signature: PlanSignature
    platform: str
    device_id: int
    kernel: str  # what runs it: "xla", "cpu"/"cpu_direct", or a GPU kernel ("conv_wgmma", ...)
    details: tuple[tuple[str, Any], ...] = ()  # the fused kernel's tile, variant, arch, origin
    mode: str = "fused"  # "auto", "fused" or "xla" (see jaxfuse.solvers)
    fused_kernel: str | None = None  # the fused candidate, prepared ("conv_wgmma 128x64 s4 b2")
    # The filter layout the fused kernel reads, where each call transposes the plan's filters
    # into it (jaxfuse.solvers.kernel_filters); None: the plan's own.
    filters: str | None = None
    # The input layout the fused kernel reads, where each call transposes the plan's input
    # into it (jaxfuse.solvers.kernel_forms); None: the plan's own.
    input_layout: str | None = None
    times_us: tuple[tuple[str, float], ...] = ()  # measured cost per run, by candidate
    device_us: tuple[tuple[str, float], ...] = ()  # its parts: device time (GPUs) ...
    host_us: tuple[tuple[str, float], ...] = ()  # ... and the host's launch work
    failures: tuple[tuple[str, str], ...] = ()  # why a candidate was dropped, by candidate
    # "measured", "disk cache", "forced" (by the mode), or "fallback" (no fused kernel here)
    decided: str = "forced"
    # Wall seconds compiling took, by step: "kernel" (generating, compiling and tuning the
    # fused kernel, or finding it in the caches; every form of it), "waited" (the kernel's
    # autotuner waiting for the device while a measurement held it: XLA's candidate compiling
    # ahead), "forms" (timing its forms against each other, where it has several) and
    # "choice" (measuring the candidates); these add up to the compile's wall time. Then
    # "xla_ahead": XLA's candidate compiled beside the kernel step (find.compile_ahead),
    # which the selection waits for only where it outlasts that step. Plans compiled
    # concurrently (jaxfuse.fuse) include their waits for each other's measurements, which
    # take the device one at a time.
    seconds: tuple[tuple[str, float], ...] = ()

    @property
    def uses_xla(self) -> bool:
        return self.kernel == XLA

    def info(self) -> dict[str, Any]:
        """What :attr:`jaxfuse.FusionPlan.kernel_info` shows."""
        info: dict[str, Any] = {"solver": self.kernel, **dict(self.details), "mode": self.mode,
                                "decided": self.decided}
        if self.fused_kernel is not None and self.uses_xla:
            info["fused_kernel"] = self.fused_kernel
        if self.filters is not None and not self.uses_xla:
            info["filters"] = f"{self.filters} (transposed on each call)"
        if self.input_layout is not None and not self.uses_xla:
            info["input_layout"] = f"{self.input_layout} (transposed on each call)"
        if self.times_us:
            info["candidates_us"] = dict(self.times_us)
        if self.host_us:
            info["candidates_device_us"] = dict(self.device_us)
            info["candidates_host_us"] = dict(self.host_us)
        if self.failures:
            info["failed"] = dict(self.failures)
        if self.seconds:
            info["compile_s"] = dict(self.seconds)
        return info

    def execute(self, x: Any, *params: Any) -> jax.Array:
        """Runs the chain with the chosen solver (traceable; operands as for fused_chain)."""
        if self.uses_xla:
            return xla_function(self.signature)(*checked_operands(self.signature, x, *params))
        if self.filters is not None or self.input_layout is not None:
            operands = form_operands(self.signature, self.filters,
                                     checked_operands(self.signature, x, *params),
                                     self.input_layout)
            return fused_chain(
                kernel_signature(self.signature, self.filters, self.input_layout), *operands)
        return fused_chain(self.signature, x, *params)


_lock = threading.Lock()  # guards the dicts and counters below, never held while compiling
_Key = tuple[str, int, PlanSignature, str]  # platform, device id, signature, solver mode
_compiled: dict[_Key, CompiledPlan] = {}


@dataclasses.dataclass
class _Compiling:
    """The lock that threads compiling one key take turns on, and how many hold or await it:
    it stays in `_compiling` until the last has left, so that a thread arriving after a failed
    compile waits for the one retrying it rather than compiling beside it."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    users: int = 0


_compiling: dict[_Key, _Compiling] = {}
_stats = {"compilations": 0, "hits": 0}


def default_device() -> Any:
    """The device `plan.compile()` targets when none is given: the default backend's first
    (``jax.devices()[0]``). Not ``jax_default_device``, which may differ from thread to
    thread: a plan is compiled once (jaxfuse's functions memoize theirs), and its fused
    call runs on whichever device of the backend its operands are on."""
    return jax.devices()[0]


def as_device(device: Any) -> Any:
    """`device` as a jax device: None is :func:`default_device`, and a platform name ("cpu",
    "gpu", "cuda", ...) that platform's first device."""
    if device is None:
        return default_device()
    if isinstance(device, str):
        try:
            return jax.devices(device)[0]
        except RuntimeError as err:
            raise ValueError(f"no {device!r} device to compile for: {err}") from None
    if not isinstance(device, jax.Device):
        raise TypeError("device must be a jax.Device (e.g. jax.devices('gpu')[0]) or a "
                        f"platform name such as 'cpu' or 'gpu', got {type(device).__name__} "
                        f"{device!r}")
    return device


def compile_signature(signature: PlanSignature, device: Any = None,
                      solver: str | None = None) -> CompiledPlan:
    """Compiles `signature` for `device` once; later calls with an equal signature are hits.

    `solver` is the mode (:func:`jaxfuse.solvers.solver_mode`): in ``"auto"`` the fused kernel
    and XLA's composition are measured and the faster kept (:mod:`jaxfuse.find`).
    Thread-safe: different signatures compile concurrently (the extension releases the GIL),
    and threads asking for the same one wait for a single compilation.
    """
    device = as_device(device)
    mode = solver_mode(solver)
    platform = device.platform.lower()
    key = (platform, device.id, signature, mode)
    with _lock:
        hit = _lookup(key)
        if hit is not None:
            return hit
        entry = _compiling.setdefault(key, _Compiling())
        entry.users += 1
    try:
        with entry.lock:
            with _lock:
                hit = _lookup(key)  # compiled by the thread this one waited for
                if hit is not None:
                    return hit
            compiled = _compile(signature, platform, device, mode)
            with _lock:  # published before the lock is released: no window for a 2nd compile
                _compiled[key] = compiled
                _stats["compilations"] += 1
            return compiled
    finally:
        with _lock:
            entry.users -= 1
            if not entry.users:
                _compiling.pop(key, None)


def _lookup(key: _Key) -> CompiledPlan | None:
    """A memoized plan, counted as a hit (with _lock held)."""
    hit = _compiled.get(key)
    if hit is not None:
        _stats["hits"] += 1
    return hit


def _compile(signature: PlanSignature, platform: str, device: Any, mode: str) -> CompiledPlan:
    common = {"signature": signature, "platform": platform, "device_id": device.id, "mode": mode}
    if mode == XLA:
        return CompiledPlan(kernel=XLA, **common)
    trial = find.Trial()  # (the candidates' input sets and harnesses, shared)
    try:
        return _select(signature, device, mode, trial, common)
    finally:  # (work queued for it and not yet done is dropped; its sets go with it)
        trial.close()


def _select(signature: PlanSignature, device: Any, mode: str, trial: find.Trial,
            common: dict[str, Any]) -> CompiledPlan:
    """The plan in mode "fused" or "auto": the fused kernel, in "auto" measured against XLA's
    composition with `trial`."""
    if mode == "auto":
        find.compile_ahead(signature, device, trial)
    try:
        fused, seconds = _prepare(signature, device, trial)
    except FusionError as err:
        if mode == "fused":
            raise
        # XLA's composition runs wherever jax does: the plan still has a solver.
        logger.debug("jaxfuse: the fused kernel for %s is not available: %s",
                     signature.describe(), err)
        return CompiledPlan(kernel=XLA, failures=(("fused", str(err)),), decided="fallback",
                            **common)
    common.update(details=fused.details, fused_kernel=fused.label, filters=fused.filters,
                  input_layout=fused.input_layout)
    if mode == "fused":
        return CompiledPlan(kernel=fused.solver, seconds=seconds, **common)
    prepared = time.perf_counter()
    decision = find.choose(signature, device, fused, trial)
    seconds += (("choice", time.perf_counter() - prepared),)
    if trial.ahead_seconds is not None:
        seconds += (("xla_ahead", trial.ahead_seconds),)
    return CompiledPlan(kernel=XLA if decision.solver == XLA else fused.solver,
                        times_us=decision.times_us, device_us=decision.device_us,
                        host_us=decision.host_us,
                        failures=decision.failures,
                        decided=decision.origin, seconds=seconds, **common)


def _prepare(signature: PlanSignature, device: Any, trial: find.Trial
             ) -> tuple[FusedKernel, tuple[tuple[str, float], ...]]:
    """The fused kernel for `signature`: of several forms (jaxfuse.solvers.prepare_forms),
    the fastest measured; and the seconds its steps took (see CompiledPlan.seconds)."""
    start, waited = time.perf_counter(), extension().timing_waited()
    forms = prepare_forms(signature, device)
    # (the autotuner's wait for a measurement on the device: XLA's candidate compiled ahead)
    waited = extension().timing_waited() - waited
    seconds: tuple[tuple[str, float], ...] = (
        ("kernel", time.perf_counter() - start - waited),)
    if waited > 0:
        seconds += (("waited", waited),)
    fused = forms[0]
    if len(forms) > 1:
        timed = time.perf_counter()
        fused = find.fastest_form(signature, device, forms, trial)
        seconds += (("forms", time.perf_counter() - timed),)
    if device.platform.lower() != "cpu":
        _warn_once_if_disk_cache_off(extension().gpu_cache(keys=False)["problem"])
    return fused, seconds


_warned_cache_problem = False


def _warn_once_if_disk_cache_off(problem: str) -> None:
    """Warns, once per process, that kernels stay in memory because the disk cache has
    `problem` (an unsafe or unwritable directory, a failed write); silent when it is ""."""
    global _warned_cache_problem
    with _lock:
        if not problem or _warned_cache_problem:
            return
        _warned_cache_problem = True
    warnings.warn(f"jaxfuse keeps GPU kernels in memory only: {problem}", RuntimeWarning,
                  stacklevel=5)


def cache_info() -> dict[str, int]:
    """Counts of plan compilations and cache hits in this process (for tests and tools)."""
    with _lock:
        return {**_stats, "size": len(_compiled)}


def clear_cache() -> None:
    """Forgets every compiled plan (the extension's kernel caches are kept)."""
    with _lock:
        _compiled.clear()
        _stats.update(compilations=0, hits=0)
