"""Compiling plan signatures for a device, memoized per (platform, device, signature)."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

import jax

from ._extension import extension
from .errors import FusionError
from .runtime import gpu_platform
from .signature import PlanSignature

__all__ = ["CompiledPlan", "cache_info", "clear_cache", "compile_signature", "default_device"]


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """A signature compiled for one device. The kernel itself lives in the extension's cache."""

    signature: PlanSignature
    platform: str
    device_id: int
    kernel: str  # the GPU solver that runs it ("conv_direct", "pointwise", ...), or "cpu"
    details: tuple[tuple[str, Any], ...] = ()  # GPU: tile, autotuned variant, arch, origin


_lock = threading.Lock()  # guards the dicts and counters below, never held while compiling
_compiled: dict[tuple[str, int, PlanSignature], CompiledPlan] = {}
_compiling: dict[tuple[str, int, PlanSignature], threading.Lock] = {}
_stats = {"compilations": 0, "hits": 0}


def default_device() -> Any:
    """The device `plan.compile()` targets when none is given: jax's default device."""
    return jax.devices()[0]


def compile_signature(signature: PlanSignature, device: Any = None) -> CompiledPlan:
    """Compiles `signature` for `device` once; later calls with an equal signature are hits.

    Thread-safe: different signatures compile concurrently (the extension releases the GIL),
    and threads asking for the same one wait for a single compilation.
    """
    device = default_device() if device is None else device
    platform = device.platform.lower()
    key = (platform, device.id, signature)
    with _lock:
        hit = _lookup(key)
        if hit is not None:
            return hit
        key_lock = _compiling.setdefault(key, threading.Lock())
    with key_lock:
        with _lock:
            hit = _lookup(key)  # compiled by the thread this one waited for
            if hit is not None:
                return hit
        try:
            compiled = _compile(signature, platform, device)
            with _lock:  # published before the per-plan lock goes: no window for a 2nd compile
                _compiled[key] = compiled
                _stats["compilations"] += 1
            return compiled
        finally:
            with _lock:
                _compiling.pop(key, None)


def _lookup(key: tuple[str, int, PlanSignature]) -> CompiledPlan | None:
    """A memoized plan, counted as a hit (with _lock held)."""
    hit = _compiled.get(key)
    if hit is not None:
        _stats["hits"] += 1
    return hit


def _compile(signature: PlanSignature, platform: str, device: Any) -> CompiledPlan:
    ext = extension()
    encoded = signature.encode()
    try:
        if platform == "cpu":
            kernel = ext.cpu_prepare(encoded)
        elif platform in ("gpu", "cuda", "rocm"):
            kernel, details = _compile_gpu(ext, encoded, device)
            return CompiledPlan(signature, platform, device.id, kernel, details)
        else:
            raise FusionError(f"jaxfuse has no backend for platform {platform!r}")
    except (RuntimeError, ValueError) as err:
        raise FusionError(f"compiling {signature.describe()} for {device} failed:\n{err}") from err
    return CompiledPlan(signature, platform, device.id, kernel)


_warned_cache_problem = False


def _compile_gpu(ext: Any, encoded: str, device: Any) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """Compiles (or finds in the kernel caches) and loads the plan's kernel on `device`."""
    platform = gpu_platform(device)
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else ordinal
    if platform == "ROCM":  # HIP cannot report its architecture name portably
        ext.gpu_register_device(platform, ordinal, str(device.compute_capability),
                                int(getattr(device, "core_count", 0)), 64 * 1024)
    kernel = ext.gpu_prepare(platform, encoded, ordinal)
    _warn_once_if_disk_cache_off(ext.gpu_cache(keys=False)["problem"])
    details = tuple((k, kernel[k]) for k in ("tile", "variant", "arch", "origin"))
    return kernel["solver"], details


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
