"""Loads the C++ extension once: configures the GPU runtime and registers the FFI handlers."""

from __future__ import annotations

import functools
from types import ModuleType

import jax

from . import runtime

__all__ = ["CONVERT_TARGET", "FFI_TARGET", "STOPWATCH_TARGET", "extension", "register_targets"]

FFI_TARGET = "jaxfuse_fused_chain"
CONVERT_TARGET = "jaxfuse_convert_many"  # many float conversions in one kernel (convert.py)
STOPWATCH_TARGET = "jaxfuse_stopwatch"  # marks device time in timing programs (measure.py)


@functools.cache
def extension() -> ModuleType:
    """The compiled `_jaxfuse_ext` module, configured with the cache and compiler paths."""
    try:
        from . import _jaxfuse_ext
    except ImportError as err:  # pragma: no cover - a broken install
        raise ImportError(
            "jaxfuse's C++ extension is missing; reinstall with `pip install .` from the "
            f"source tree ({err})") from err
    try:
        kernels, why_off = runtime.kernel_cache_dir(), ""
    except RuntimeError as err:  # an unusable path only turns the disk cache off (SECURITY.md)
        kernels, why_off = None, str(err)
    _jaxfuse_ext.gpu_configure(str(kernels) if kernels else "", runtime.compiler_search_paths(),
                               why_off)
    return _jaxfuse_ext


@functools.cache
def register_targets() -> None:
    """Registers the fused-chain handlers for every platform and the batched conversion's for
    the GPU platforms (done at ``import jaxfuse``, so a deserialized ``jax.export`` program
    finds them too). The fused chain's GPU handlers keep a state per call (the parsed plan),
    whose type the platform's runtime must know first."""
    for platform, registration in extension().ffi_types().items():
        jax.ffi.register_ffi_type(f"{FFI_TARGET}_state", registration, platform=platform)
    for platform, handler in extension().ffi_handlers().items():
        jax.ffi.register_ffi_target(FFI_TARGET, handler, platform=platform)
    for platform, handler in extension().convert_handlers().items():
        jax.ffi.register_ffi_target(CONVERT_TARGET, handler, platform=platform)
    for platform in ("CUDA", "ROCM"):
        jax.ffi.register_ffi_target(STOPWATCH_TARGET, extension().stopwatch_handler(),
                                    platform=platform)
