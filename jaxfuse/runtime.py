"""Where the GPU backend finds its runtime compiler and keeps its kernel cache.

Kernels are compiled at plan-compile time by NVRTC (CUDA) or hiprtc (ROCm), loaded at run time
from, in order: ``$JAXFUSE_NVRTC`` / ``$JAXFUSE_HIPRTC``; the NVIDIA wheels jax's CUDA plugin
installs (``nvidia/cu13/lib``, ``nvidia/cuda_nvrtc/lib``); ``$CUDA_HOME``/``$CUDA_PATH``; the
system's library path. Compiled kernels are cached in memory and on disk under
``$JAXFUSE_CACHE_DIR`` (default ``~/.cache/jaxfuse``); ``JAXFUSE_CACHE_DIR=""`` keeps them in
memory only. Only a directory of the user's own that others cannot write is used, and every
entry is verified before it is loaded (SECURITY.md).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "compiler_search_paths", "gpu_ordinal", "gpu_platform",
           "kernel_cache_dir"]


def cache_dir() -> Path | None:
    """jaxfuse's cache directory, or None when disk caching is off (``JAXFUSE_CACHE_DIR=""``).

    Raises RuntimeError, naming where the path came from, when it cannot be resolved (``~user``
    of an unknown user, no home directory).
    """
    value = os.environ.get("JAXFUSE_CACHE_DIR")
    try:
        if value is None:
            return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxfuse"
        return Path(value).expanduser() if value else None
    except RuntimeError as err:  # pathlib's "Could not determine home directory."
        origin = ("the default, ~/.cache/jaxfuse" if value is None
                  else f"JAXFUSE_CACHE_DIR={value!r}")
        raise RuntimeError(f"the kernel cache directory ({origin}) cannot be resolved: "
                           f"{err}") from err


def kernel_cache_dir() -> Path | None:
    """Where compiled GPU kernels are kept (a ``kernels`` folder in :func:`cache_dir`)."""
    root = cache_dir()
    return None if root is None else root / "kernels"


def compiler_search_paths() -> list[str]:
    """Folders that may hold the runtime compiler, most specific first."""
    paths: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            if (Path(root) / sub).is_dir():
                paths.append(str(Path(root) / sub))
    for env in ("CUDA_HOME", "CUDA_PATH", "ROCM_PATH"):
        if os.environ.get(env):
            paths += [str(Path(os.environ[env]) / "lib64"), str(Path(os.environ[env]) / "lib")]
    return paths


def gpu_platform(device: Any) -> str:
    """"CUDA" or "ROCM" for a jax GPU device (jax calls both platform "gpu")."""
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "ROCM" if "rocm" in version or "hip" in version else "CUDA"


def gpu_ordinal(device: Any) -> int:
    """The device's index for the driver (its local hardware id; jax's id where none)."""
    ordinal = getattr(device, "local_hardware_id", None)
    return device.id if ordinal is None else ordinal
