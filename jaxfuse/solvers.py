"""The solvers a plan can run on (MIOpen's word), and how a user picks between them.

Two solvers compete for every plan signature on a device:

- **fused**: jaxfuse's own kernel for the plan, one launch for the whole chain. On GPUs the
  extension generates it and autotunes its tile variants itself (``csrc/gpu/autotune.cc``);
  ``kernel_info["solver"]`` then names the kernel family (``conv_wgmma``, ``pointwise``, ...),
  ``"cpu"`` or ``"cpu_direct"`` on the host.
- **xla**: the unfused composition, written as a user writes the chain in jax, as XLA compiles
  it (with cuDNN and cuBLAS on GPUs): what plain ``jax.jit`` runs for the chain.

Each solver answers the same three questions: can it run the signature here (and if not,
why), how to prepare it on a device, and the traceable function that runs it. Neither knows
about the other; :mod:`jaxfuse.find` measures both and keeps the faster.

Which solvers are considered is the *mode*: ``"auto"`` (measure, keep the fastest correct
one; the default), ``"fused"`` (jaxfuse's kernel, or an error saying why it cannot run) or
``"xla"``. The mode comes from ``plan.compile(solver=...)`` / ``jaxfuse.fuse(fn, solver=...)``,
else the ``JAXFUSE_SOLVER`` environment variable, else ``"auto"``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._extension import extension
from .activations import ActivationMode, jax_activation
from .errors import FusionError
from .primitive import fused_chain_p
from .runtime import gpu_ordinal, gpu_platform
from .signature import SCALARS, PlanSignature

__all__ = ["MODES", "XLA", "FusedKernel", "SolverMode", "form_operands", "fused_function",
           "kernel_filters", "kernel_forms", "kernel_signature", "prepare_forms", "prepare_fused",
           "solver_mode", "with_filters", "xla_function"]

logger = logging.getLogger("jaxfuse")

SolverMode = Literal["auto", "fused", "xla"]
MODES: tuple[str, ...] = ("auto", "fused", "xla")
XLA = "xla"  # the xla solver's name in kernel_info


def solver_mode(mode: str | None = None) -> SolverMode:
    """The mode to use: `mode` if given, else ``$JAXFUSE_SOLVER``, else ``"auto"``."""
    source = "solver"
    if mode is None:
        mode, source = os.environ.get("JAXFUSE_SOLVER") or "auto", "JAXFUSE_SOLVER"
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ValueError(f"{source} must be one of {', '.join(MODES)}; got {mode!r}")
    return mode.lower()  # type: ignore[return-value]


# ----- fused: jaxfuse's own kernel ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FusedKernel:
    """jaxfuse's kernel for a signature, prepared (compiled and loaded) on a device."""

    solver: str  # "cpu"/"cpu_direct", or the GPU kernel family ("conv_wgmma", "pointwise", ...)
    details: tuple[tuple[str, Any], ...] = ()  # GPU: tile, autotuned variant, arch, origin
    # The filter layout the kernel reads where it is not the plan's: each call then transposes
    # the plan's filters into it first (see kernel_filters); None: the plan's own.
    filters: str | None = None
    # The input layout the kernel reads where it is not the plan's: each call transposes the
    # input into it first, and the kernel writes the plan's layout (see kernel_forms).
    input_layout: str | None = None

    @property
    def label(self) -> str:
        """The kernel and its tile, e.g. ``conv_wgmma 128x64 s4 b2`` (and ``, OHWI filters``
        or ``, NHWC input`` where operands are transposed for it)."""
        tile = dict(self.details).get("tile")
        label = f"{self.solver} {tile}" if tile else self.solver
        if self.input_layout:
            label += f", {self.input_layout} input"
        return f"{label}, {self.filters} filters" if self.filters else label


# fp32 plans on Hopper run on TF32 wgmma, which reads filters K-major only ([k][r][s][c], OHWI).
# The kernels transpose HWIO filters themselves as they load them, 4 bytes a copy, at about half
# the speed of the copy engine's K-major tiles: on an H100 (2026-11-25, fp32 ResNet-50 layers
# at batch 64, conv_tma) the 3x3 layers took 103-116 us with HWIO filters and 52-62 us with
# OHWI ones, the 1x1/2048 layer 58.7 against 36.2 us. Transposing the filters in a separate op
# on every call moves 2x their bytes through memory (about 8 us for a 3x3/512 layer's 9.4 MB),
# which pays where they are reused over many output pixels.
_TRANSPOSE_MIN_PIXELS = 2048
# The kernels the transposed form is for (TF32 on wgmma: 32k input channels per group); any
# other kernel reads HWIO as fast, and the direct one far slower from OHWI (the ResNet-50 stem,
# 3 channels, at batch 64 on an H100: 10.2 ms against 2.2 ms).
_K_MAJOR_KERNELS = ("conv_tma", "conv_wgmma")
_TF32_K_TILE = 32


def _tf32_on_hopper(signature: PlanSignature, device: Any) -> bool:
    """Whether `signature`'s convolution may run on Hopper's TF32 wgmma kernels: fp32 with
    TF32 allowed, 32-channel k-tiles per group, not switched off."""
    c = signature.conv
    return (c is not None and device.platform.lower() != "cpu"
            and signature.dtype == np.float32 and c.allow_tf32
            and (signature.channels // c.groups) % _TF32_K_TILE == 0
            and os.environ.get("JAXFUSE_TF32_KERNELS") != "0"  # as csrc/gpu/codegen.cc reads it
            and str(getattr(device, "compute_capability", "")) == "9.0")


def kernel_filters(signature: PlanSignature, device: Any) -> str | None:
    """The filter layout the fused kernel should read for `signature` on `device`, where the
    filters are worth transposing into it on every call (see above); None: the plan's own.

    A rule from the measurements above, not a measurement per plan: the find step times the
    form it gives (transpose included) against XLA, never against the other fused form."""
    if (not _tf32_on_hopper(signature, device) or signature.layout != "NHWC"
            or signature.conv.filter_layout != "HWIO"):
        return None
    _, p, q = signature.output_chw
    return "OHWI" if signature.batch * p * q >= _TRANSPOSE_MIN_PIXELS else None


# NCHW plans on Hopper: the tensor-core kernels gather NCHW activations value by value (a
# channel's plane is H*W values from the next), at 0.6-1.0x XLA for 3x3 layers, where the
# copy engine lands NHWC tiles whole. So they may also run a kernel that reads the input
# transposed to NHWC (one XLA transpose a call, as XLA itself does around cuDNN) with HWIO
# filters, and writes NCHW from its epilogue. Which form is faster depends on the layer (1x1
# layers gather fast, and their input may be larger than their output): both are measured
# (jaxfuse.find.fastest_form).
_NHWC_FORM_MIN_PIXELS = 2048
# fp32 NCHW plans: the TF32 kernels read NHWC activations and K-major filters (OHWI, or a 1x1
# layer's own OIHW), so their form transposes both. The plans' own kernel (conv_igemm, NCHW)
# ran ResNet-50's 3x3 layers at 0.16-0.51x XLA on four H200s (2026-11-28); with the form,
# auto mode ran every measured fp32 NCHW suite case at 1.00x XLA or more by queued time (92
# cases, batch 1 and 64), 21 that it had left to XLA's composition (ResNet-50's 3x3 and 1x1
# layers, 19 of them at batch 64) at 1.03-1.88x, and the forced kernels ran 1.24x faster in
# geomean (same GPUs, 2026-11-28, twenty-fifth session). On by default;
# JAXFUSE_TF32_NCHW_FORM=0 withdraws it. The find step keeps it only where it agrees with the
# plan's own kernel and is faster. It is offered at every size: below 2048 output pixels
# (ResNet-50 from 28x28 down at batch 1) the plans' own kernel ran the 3x3 layers at
# 0.17-0.33x XLA, so auto mode kept XLA's composition; with the form (split-K TF32 kernels
# there) auto mode ran every fp32 NCHW suite case at batch 1 at 1.11x XLA or more, the 22 it
# had left to XLA at 1.12-2.16x, and none more than noise slower than without it (80 cases by
# queued time, two H200s, 2026-11-28, twenty-sixth session).
_TF32_FORM_VARIABLE = "JAXFUSE_TF32_NCHW_FORM"


def with_filters(signature: PlanSignature, layout: str) -> PlanSignature:
    """`signature` with its filters in `layout`."""
    assert signature.conv is not None
    return dataclasses.replace(
        signature, conv=dataclasses.replace(signature.conv, filter_layout=layout))


def kernel_signature(signature: PlanSignature, filters: str | None = None,
                     layout: str | None = None) -> PlanSignature:
    """The signature of the kernel that runs `signature` with its filters in `filters` and its
    input in `layout` (None: the plan's own); the output keeps the plan's layout."""
    if filters is not None:
        signature = with_filters(signature, filters)
    if layout is not None and layout != signature.layout:
        signature = dataclasses.replace(signature, layout=layout,
                                        output_layout=signature.out_layout)
    return signature


_TO_LAYOUT = {("NCHW", "NHWC"): (0, 2, 3, 1), ("NHWC", "NCHW"): (0, 3, 1, 2)}


def form_operands(signature: PlanSignature, filters: str | None,
                  operands: Sequence[Any], layout: str | None = None) -> list[Any]:
    """The primitive's operands for the kernel form ``kernel_signature(signature, filters,
    layout)``: `operands` (those of `signature`) with the filters and the input transposed."""
    assert signature.conv is not None
    names = [spec.name for spec in signature.operands]
    out = list(operands)
    if filters is not None and filters != signature.conv.filter_layout:
        at = names.index("w")
        out[at] = jnp.transpose(out[at], _filter_permutation(signature.conv.filter_layout,
                                                             filters))
    if layout is not None and layout != signature.layout:
        at = names.index("x")
        out[at] = jnp.transpose(out[at], _TO_LAYOUT[(signature.layout, layout)])
    return out


def _filter_permutation(source: str, target: str) -> tuple[int, ...]:
    """The axes of `source`-ordered filters in `target` order."""
    return tuple(source.index(axis) for axis in target)


def kernel_forms(signature: PlanSignature, device: Any) -> list[tuple[str | None, str | None]]:
    """The (filters, input layout) forms worth compiling for `signature` on `device` besides
    its own, see above: NCHW plans with a convolution on Hopper that the kernels which write
    the form take (16-bit: 64-channel groups, or a few-channel stem; fp32 through TF32 unless
    JAXFUSE_TF32_NCHW_FORM=0: 32-channel groups, at any size), 16-bit ones with enough output
    pixels that the transposes are a small part of the call."""
    c = signature.conv
    if (c is None or device.platform.lower() == "cpu"
            or signature.layout != "NCHW" or signature.filter_dtype != signature.dtype
            or os.environ.get("JAXFUSE_NHWC_FORM") == "0"
            or str(getattr(device, "compute_capability", "")) != "9.0"):
        return []
    if signature.dtype == np.float32:
        if os.environ.get(_TF32_FORM_VARIABLE) == "0" or not _tf32_on_hopper(signature, device):
            return []
        one_tap = c.filter_h == c.filter_w == 1
        return [("OIHW" if one_tap and c.filter_layout == "OIHW" else "OHWI", "NHWC")]
    _, p, q = signature.output_chw
    if signature.batch * p * q < _NHWC_FORM_MIN_PIXELS:
        return []
    # (csrc/gpu/codegen.cc: WgmmaApplies' 64-channel k-tiles, StemApplies' few channels)
    per_group = signature.channels // c.groups
    tensor_cores = per_group % 64 == 0 or (signature.channels <= 4 and c.groups == 1
                                           and c.dilation == (1, 1))
    return [("HWIO", "NHWC")] if tensor_cores else []


# The kernels that write an output layout other than their input's (csrc/gpu/codegen.cc).
_LAYOUT_KERNELS = ("conv_tma", "conv_wgmma", "conv_stem")


def prepare_forms(signature: PlanSignature, device: Any) -> list[FusedKernel]:
    """jaxfuse's kernels for `signature` on `device`: :func:`prepare_fused`'s, then one for
    each of :func:`kernel_forms` that compiles to a kernel it is for (a form that fails is
    left out; the plan's own form raises as prepare_fused does)."""
    kernels = [prepare_fused(signature, device)]
    for filters, layout in kernel_forms(signature, device):
        try:
            kernel = _prepare(kernel_signature(signature, filters, layout), device)
        except FusionError as err:
            logger.debug("jaxfuse: %s with %s input: %s", signature.describe(), layout, err)
            continue
        if kernel.solver in _LAYOUT_KERNELS:
            own = filters == signature.conv.filter_layout  # (not transposed then)
            kernels.append(dataclasses.replace(kernel, filters=None if own else filters,
                                               input_layout=layout))
    return kernels


def prepare_fused(signature: PlanSignature, device: Any) -> FusedKernel:
    """Compiles (or finds in the caches) jaxfuse's kernel for `signature` on `device`, reading
    the filters in :func:`kernel_filters`'s layout.

    Raises FusionError saying why when the backend cannot run it (no backend for the platform,
    a compiler failure with its log, a refused plan).
    """
    filters = kernel_filters(signature, device)
    if filters is not None:
        try:
            kernel = _prepare(with_filters(signature, filters), device)
        except FusionError as err:  # the plan's own form may still compile
            kernel = None
            logger.debug("jaxfuse: %s with %s filters: %s", signature.describe(), filters, err)
        if kernel is not None and kernel.solver in _K_MAJOR_KERNELS:
            return dataclasses.replace(kernel, filters=filters)
    return _prepare(signature, device)


def _prepare(signature: PlanSignature, device: Any) -> FusedKernel:
    platform = device.platform.lower()
    ext = extension()
    encoded = signature.encode()
    try:
        if platform == "cpu":
            return FusedKernel(ext.cpu_prepare(encoded))
        if platform in ("gpu", "cuda", "rocm"):
            return _prepare_gpu(ext, encoded, device)
    except (RuntimeError, ValueError) as err:
        raise FusionError(f"compiling {signature.describe()} for {device} failed:\n{err}") from err
    raise FusionError(f"jaxfuse has no backend for platform {platform!r}")


def _prepare_gpu(ext: Any, encoded: str, device: Any) -> FusedKernel:
    platform, ordinal = gpu_platform(device), gpu_ordinal(device)
    if platform == "ROCM":  # HIP cannot report its architecture name portably
        ext.gpu_register_device(platform, ordinal, str(device.compute_capability),
                                int(getattr(device, "core_count", 0)), 64 * 1024)
    kernel = ext.gpu_prepare(platform, encoded, ordinal)
    details = tuple((k, kernel[k]) for k in ("tile", "variant", "arch", "origin"))
    return FusedKernel(kernel["solver"], details)


def fused_function(signature: PlanSignature, filters: str | None = None,
                   layout: str | None = None) -> Callable[..., jax.Array]:
    """The fused kernel as a traceable function of the primitive's operands; with `filters`
    (`layout`), the kernel for filters (an input) in that layout, transposed into it first."""
    target = kernel_signature(signature, filters, layout)

    def run(*operands: Any) -> jax.Array:
        if target != signature:
            operands = tuple(form_operands(signature, filters, operands, layout))
        return fused_chain_p.bind(*operands, signature=target)

    return run


# ----- xla: the unfused composition --------------------------------------------------------------
# Activations that are exact in any dtype (max, min, select, one multiply): XLA may fold them
# into cuDNN's fused convolution when they run in the data dtype. The others run in float32.
_PIECEWISE_LINEAR = {ActivationMode.PASSTHRU, ActivationMode.RELU, ActivationMode.CLIPPED_RELU,
                     ActivationMode.LEAKY_RELU, ActivationMode.ABS}


def xla_function(signature: PlanSignature) -> Callable[..., jax.Array]:
    """The unfused composition as a traceable function of the primitive's operands: the chain
    as a user writes it in jax (each step in the data dtype, in the plan's layout), so XLA
    compiles exactly what plain ``jax.jit`` would: cuDNN's convolution with what it fuses,
    then one loop fusion for the rest. Results differ from the fused kernel's (one rounding,
    float32 epilogue) by rounding only."""

    def run(*operands: Any) -> jax.Array:
        return _composition(signature, *operands)

    return run


def _composition(signature: PlanSignature, *operands: Any) -> jax.Array:
    ops = dict(zip((spec.name for spec in signature.operands), operands))
    dtype = signature.dtype
    scalars = dict(zip(SCALARS, (ops["scalars"][i] for i in range(len(SCALARS)))))
    channel_axis = 1 if signature.out_layout == "NCHW" else 3

    def per_channel(p: Any, bn: bool = False) -> Any:
        p = jnp.asarray(p)
        if bn and signature.bn_mode == "per_activation":
            return p[None].astype(dtype)
        shape = [1, 1, 1, 1]
        shape[channel_axis] = -1
        return p.reshape(shape).astype(dtype)

    y = ops["x"]
    for letter in signature.ops:
        if letter == "C":
            c = signature.conv
            w = ops["w"]
            if w.dtype != dtype:  # float32 filters of a 16-bit plan: rounded, then used
                w = w.astype(dtype)
            y = lax.conv_general_dilated(
                y, w, c.strides, c.padding, rhs_dilation=c.dilation,
                dimension_numbers=(signature.layout, c.filter_layout, signature.out_layout),
                feature_group_count=c.groups,
                precision=None if c.allow_tf32 else lax.Precision.HIGHEST)
            y = y * scalars["conv_alpha"].astype(dtype)
        elif letter == "B":
            y = y + per_channel(ops["bias"])
        elif letter == "N":
            inv = ops["scale"] * lax.rsqrt(ops["var"] + scalars["bn_epsilon"])
            y = (y - per_channel(ops["mean"], True)) * per_channel(inv, True) + \
                per_channel(ops["shift"], True)
        elif letter == "S":
            y = y + scalars["side_alpha"].astype(dtype) * ops["side"]
        elif letter == "A":
            mode = signature.activation
            params = (scalars["act_alpha"], scalars["act_beta"], scalars["act_gamma"])
            if mode in _PIECEWISE_LINEAR:
                y = jax_activation(mode, y, *(p.astype(dtype) for p in params))
            else:
                y = jax_activation(mode, y.astype(jnp.float32), *params).astype(dtype)
    return y.astype(dtype)
