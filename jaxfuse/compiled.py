"""Compiling plan signatures for a device, memoized per (platform, device, signature)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax

from ._extension import extension
from .errors import FusionError
from .signature import PlanSignature

__all__ = ["CompiledPlan", "cache_info", "clear_cache", "compile_signature", "default_device"]


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """A signature compiled for one device. The kernel itself lives in the extension's cache."""

    signature: PlanSignature
    platform: str
    device_id: int
    kernel: str  # the kernel's name, or "cpu"


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
            ordinal = getattr(device, "local_hardware_id", None)
            kernel = ext.gpu_prepare(encoded, device.id if ordinal is None else ordinal)
        else:
            raise FusionError(f"jaxfuse has no backend for platform {platform!r}")
    except (RuntimeError, ValueError) as err:
        raise FusionError(f"compiling {signature.describe()} for {device} failed:\n{err}") from err
    return CompiledPlan(signature, platform, device.id, kernel)


def cache_info() -> dict[str, int]:
    """Counts of plan compilations and cache hits in this process (for tests and tools)."""
    with _lock:
        return {**_stats, "size": len(_compiled)}


def clear_cache() -> None:
    """Forgets every compiled plan (the extension's kernel caches are kept)."""
    with _lock:
        _compiled.clear()
        _stats.update(compilations=0, hits=0)
