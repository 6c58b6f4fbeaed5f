"""Loads the C++ extension once: configures the GPU runtime and registers the FFI handlers."""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import threading
from types import ModuleType

import jax

from . import runtime

__all__ = ["CONVERT_TARGET", "FFI_TARGET", "RECORD_TARGET", "STOPWATCH_TARGET", "extension",
           "record_target", "register_targets"]

FFI_TARGET = "jaxfuse_fused_chain"
CONVERT_TARGET = "jaxfuse_convert_many"  # many float conversions in one kernel (convert.py)
STOPWATCH_TARGET = "jaxfuse_stopwatch"  # marks device time in timing programs (measure.py)
# The fused chain on CUDA with XLA FFI's record stage (record_target); and the probe target
# whose handler receives the CUDA plugin's FFI API, through which that one is registered.
RECORD_TARGET = "jaxfuse_fused_chain_recorded"
API_PROBE_TARGET = "jaxfuse_ffi_api_probe"

logger = logging.getLogger("jaxfuse")
_PACKAGE = pathlib.Path(__file__).resolve().parent


@functools.cache
def extension() -> ModuleType:
    """The compiled `_jaxfuse_ext` module, configured with the cache and compiler paths."""
    try:
        from . import _jaxfuse_ext
    except ImportError as err:  # pragma: no cover - a broken install
        hint = _missing_hint(_PACKAGE)
        raise ImportError(f"jaxfuse's C++ extension is missing; {hint} ({err})") from err
    try:
        kernels, why_off = runtime.kernel_cache_dir(), ""
    except RuntimeError as err:  # an unusable path only turns the disk cache off (SECURITY.md)
        kernels, why_off = None, str(err)
    _jaxfuse_ext.gpu_configure(str(kernels) if kernels else "", runtime.compiler_search_paths(),
                               why_off)
    return _jaxfuse_ext


def _missing_hint(package: pathlib.Path) -> str:
    """What to do about a missing extension in `package`: a source checkout shadowing the
    installed package (Python imports ./jaxfuse first when run from the repository's root) is
    the usual cause."""
    if (package.parent / "pyproject.toml").is_file() and (package.parent / "csrc").is_dir():
        return (f"Python imported the source folder {package}, which holds no build: run from "
                "another directory to use the installed package, or install this checkout in "
                "place with `pip install -e .`")
    return "reinstall with `pip install .` from the source tree"


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
    if hasattr(extension(), "ffi_api_probe"):
        jax.ffi.register_ffi_target(API_PROBE_TARGET, extension().ffi_api_probe(),
                                    platform="CUDA")
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():  # (else at the first CUDA lowering)
            record_target()


_record_lock = threading.Lock()
_record_state: dict[str, str | None] = {}


def record_stage_wanted() -> bool:
    """Whether CUDA programs should name the record-stage registration (``JAXFUSE_FFI_RECORD``,
    default on)."""
    return os.environ.get("JAXFUSE_FFI_RECORD", "1") != "0"


def pdl_wanted() -> bool:
    """Whether recorded launches ask for programmatic dependent launch (``JAXFUSE_PDL``,
    default on; the record stage reads the same variable: csrc/ffi/gpu_handler.cc)."""
    return os.environ.get("JAXFUSE_PDL", "1") != "0"


def record_target() -> str | None:
    """The name of the fused chain's CUDA registration with XLA FFI's record stage, or None
    where there is none (the build's FFI headers lack the stage, the CUDA plugin's FFI API
    differs, ``JAXFUSE_FFI_RECORD=0``): then :data:`FFI_TARGET`, whose CUDA bundle XLA captures
    into command buffers from its execute stage, serves.

    jaxlib 0.11.2's Python registration drops a handler dict's "record" stage, so this bundle is
    registered through the plugin's own FFI API, which the probe target received when the CUDA
    backend registered it (csrc/ffi/record_registration.cc). Called at lowering, once the
    backend exists (and at import where it already does); a registration refused by XLA is
    not tried again. A program compiled with this target and serialized as an executable
    (not through ``jax.export``, whose programs name :data:`FFI_TARGET`) finds it in another
    process only once that process has lowered a CUDA program or called this function."""
    if not record_stage_wanted():
        return None
    ext = extension()
    if not hasattr(ext, "register_cuda_record"):
        return None
    with _record_lock:
        if "name" not in _record_state:
            status, why = ext.register_cuda_record(RECORD_TARGET)
            if status == "no api yet":
                return None  # no CUDA backend yet: ask again at the next lowering
            if status != "done":
                logger.debug("jaxfuse: the fused chain's record stage is not registered: %s",
                             why)
            _record_state["name"] = RECORD_TARGET if status == "done" else None
        return _record_state["name"]
