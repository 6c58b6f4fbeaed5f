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


_lock = threading.Lock()
_compiled: dict[tuple[str, int, PlanSignature], CompiledPlan] = {}
_stats = {"compilations": 0, "hits": 0}


def default_device() -> Any:
    """The device `plan.compile()` targets when none is given: jax's default device."""
    return jax.devices()[0]


def compile_signature(signature: PlanSignature, device: Any = None) -> CompiledPlan:
    """Compiles `signature` for `device` once; later calls with an equal signature are hits."""
    device = default_device() if device is None else device
    platform = device.platform.lower()
    key = (platform, device.id, signature)
    with _lock:
        hit = _compiled.get(key)
        if hit is not None:
            _stats["hits"] += 1
            return hit
        compiled = _compile(signature, platform, device)
        _compiled[key] = compiled
        _stats["compilations"] += 1
        return compiled


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
    global _warned_cache_problem
    platform = gpu_platform(device)
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else ordinal
    if platform == "ROCM":  # HIP cannot report its architecture name portably
        ext.gpu_register_device(platform, ordinal, str(device.compute_capability),
                                int(getattr(device, "core_count", 0)), 64 * 1024)
    kernel = ext.gpu_prepare(platform, encoded, ordinal)
    problem = ext.gpu_cache()["problem"]
    if problem and not _warned_cache_problem:
        _warned_cache_problem = True
        warnings.warn(f"jaxfuse keeps GPU kernels in memory only: {problem}", RuntimeWarning,
                      stacklevel=4)
    details = tuple((k, kernel[k]) for k in ("tile", "variant", "arch", "origin"))
    return kernel["solver"], details


def cache_info() -> dict[str, int]:
    """Counts of plan compilations and cache hits in this process (for tests and tools)."""
    with _lock:
        return {**_stats, "size": len(_compiled)}


def clear_cache() -> None:
    """Forgets every compiled plan (the extension's kernel caches are kept)."""
    with _lock:
        _compiled.clear()
        _stats.update(compilations=0, hits=0)
