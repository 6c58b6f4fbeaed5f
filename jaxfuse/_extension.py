"""Loads the C++ extension once and registers its FFI handlers with XLA."""

from __future__ import annotations

import functools
from types import ModuleType

import jax

__all__ = ["FFI_TARGET", "extension", "register_targets"]

FFI_TARGET = "jaxfuse_fused_chain"


@functools.cache
def extension() -> ModuleType:
    """The compiled `_jaxfuse_ext` module (loaded once, by `import jaxfuse`)."""
    try:
        from . import _jaxfuse_ext
    except ImportError as err:  # pragma: no cover - a broken install
        raise ImportError(
            "jaxfuse's C++ extension is missing; reinstall with `pip install .` from the "
            f"source tree ({err})") from err
    return _jaxfuse_ext


@functools.cache
def register_targets() -> None:
    """Registers the fused-chain handler for every platform the extension was built for.

    Runs at `import jaxfuse` (before any backend starts; registration does not need one), so
    programs deserialized with ``jax.export`` find the target without tracing jaxfuse first.
    """
    ext = extension()
    for platform, capsule in ext.ffi_handlers().items():
        jax.ffi.register_ffi_target(FFI_TARGET, capsule, platform=platform)
