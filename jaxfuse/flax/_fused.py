"""The inference path of the Flax layers: Flax conventions in, one fused plan out.

Flax layers are channels-last (NHWC inputs, HWIO kernels), accept any number of leading batch
dimensions, and pick the computation dtype from `dtype` or by promotion. This module maps those
conventions onto :mod:`jaxfuse.functional` calls; the linen and NNX modules only read their
variables and call it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import functional
from ..descriptors import canonical_dtype
from ._activation import Activation

__all__ = ["BatchNormParams", "ConvGeometry", "batchnorm_activation", "conv_activation",
           "conv_geometry", "feature_axis", "promoted_dtype"]

_NHWC = ("NHWC", "HWIO", "NHWC")
# Flax pads the input itself for these padding modes, then convolves with VALID padding.
_PAD_MODES = {"CIRCULAR": "wrap", "REFLECT": "reflect"}


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution's geometry, in the form the fused op takes."""

    kernel_size: tuple[int, int]
    strides: tuple[int, int]
    padding: str | tuple[tuple[int, int], tuple[int, int]]  # lax padding
    pad_mode: str | None  # jnp.pad mode applied to the input first (CIRCULAR, REFLECT)
    dilation: tuple[int, int]
    groups: int


def _pair(value: int | Sequence[int] | None, what: str, owner: str) -> tuple[int, int]:
    if value is None:  # flax accepts None for 1
        value = 1
    if isinstance(value, (int, np.integer)):
        return (int(value), int(value))
    value = tuple(value)
    if len(value) != 2:
        raise ValueError(f"{owner}: {what} must be an int or a pair for a 2-D convolution, "
                         f"got {value!r}")
    return (int(value[0]), int(value[1]))


def conv_geometry(*, kernel_size: Sequence[int], strides: Any, padding: Any,
                  input_dilation: Any, kernel_dilation: Any, feature_group_count: int,
                  owner: str) -> ConvGeometry:
    """Validates Flax Conv arguments for fusion; raises ValueError naming what cannot fuse."""
    if isinstance(kernel_size, (int, np.integer)) or len(tuple(kernel_size)) != 2:
        raise ValueError(f"{owner} fuses 2-D convolutions only: kernel_size must be a pair "
                         f"(kh, kw), got {kernel_size!r}")
    if _pair(input_dilation, "input_dilation", owner) != (1, 1):
        raise ValueError(f"{owner}: input_dilation={input_dilation!r} (a transposed "
                         "convolution) cannot be fused; use flax's Conv")
    pad_mode = None
    if isinstance(padding, str):
        padding = padding.upper()
        if padding in _PAD_MODES:
            pad_mode, padding = _PAD_MODES[padding], "VALID"
        elif padding not in ("SAME", "VALID"):
            raise ValueError(f"{owner}: padding {padding!r} cannot be fused; use 'SAME', "
                             "'VALID', 'CIRCULAR', 'REFLECT', an int, or two ints or (low, "
                             "high) pairs")
    elif isinstance(padding, (int, np.integer)):
        padding = ((int(padding),) * 2,) * 2
    else:
        pairs = []
        for entry in tuple(padding) if isinstance(padding, Sequence) else ():
            pairs.append((int(entry),) * 2 if isinstance(entry, (int, np.integer))
                         else tuple(int(p) for p in entry))
        if len(pairs) != 2 or any(len(p) != 2 for p in pairs):
            raise ValueError(f"{owner}: padding {padding!r} must be a string, an int, or two "
                             "ints or (low, high) pairs for a 2-D convolution")
        padding = (pairs[0], pairs[1])
    groups = int(feature_group_count)
    if groups < 1:
        raise ValueError(f"{owner}: feature_group_count must be >= 1, got {groups}")
    return ConvGeometry(kernel_size=(int(kernel_size[0]), int(kernel_size[1])),
                        strides=_pair(strides, "strides", owner), padding=padding,
                        pad_mode=pad_mode, dilation=_pair(kernel_dilation, "kernel_dilation",
                                                          owner), groups=groups)


def promoted_dtype(*arrays: Any, dtype: Any = None) -> np.dtype:
    """Flax's rule: `dtype` if given, else the promoted type of the arrays (at least inexact)."""
    if dtype is None:
        dtype = jnp.result_type(*(a for a in arrays if a is not None))
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    # As jax does: float64 means float32 unless x64 is enabled.
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


class BatchNormParams(NamedTuple):
    """A batch norm's variables (scale/bias None when the layer does not use them)."""

    scale: Any
    bias: Any
    mean: Any
    var: Any
    epsilon: float

    def filled(self) -> tuple[Any, Any, Any, Any]:
        """scale, shift, mean, var with ones/zeros standing in for unused scale/bias."""
        shape = jnp.shape(self.mean)
        scale = jnp.ones(shape, jnp.float32) if self.scale is None else self.scale
        shift = jnp.zeros(shape, jnp.float32) if self.bias is None else self.bias
        return scale, shift, self.mean, self.var


def _compute_dtype(dtype: Any, owner: str) -> np.dtype:
    return canonical_dtype(dtype, f"{owner}: the fused kernel's computation dtype")


def _precision(precision: Any, owner: str) -> Any:
    if isinstance(precision, (tuple, list)):
        if len(set(precision)) != 1:
            raise ValueError(f"{owner}: per-operand precision {precision!r} cannot be fused; "
                             "give one precision")
        precision = precision[0]
    return precision


def conv_activation(x: Any, kernel: Any, bias: Any, bn: BatchNormParams | None,
                    geometry: ConvGeometry, *, compute_dtype: Any, out_dtype: Any,
                    precision: Any, activation: Activation | None, owner: str) -> jax.Array:
    """``activation(bn(conv(x, kernel) + bias))`` in one fused plan, Flax conventions.

    `x` is ``(*batch, H, W, C)`` (no batch dimension is allowed too), `kernel` HWIO; `bias` and
    `bn` may be None. The conv runs in `compute_dtype`; the result is cast to `out_dtype`.
    """
    if x.ndim < 3:
        raise ValueError(f"{owner}: input must be (*batch, height, width, features), got shape "
                         f"{x.shape}")
    dt = _compute_dtype(compute_dtype, owner)
    batch_shape = x.shape[:-3]
    x = jnp.reshape(x, (-1, *x.shape[-3:])).astype(dt)
    if geometry.pad_mode is not None:
        pads = [(0, 0)] + [((k - 1) * d // 2, (k - 1) * d - (k - 1) * d // 2)
                           for k, d in zip(geometry.kernel_size, geometry.dilation)] + [(0, 0)]
        x = jnp.pad(x, pads, mode=geometry.pad_mode)
    conv_kwargs = {"window_strides": geometry.strides, "padding": geometry.padding,
                   "rhs_dilation": geometry.dilation, "feature_group_count": geometry.groups,
                   "dimension_numbers": _NHWC, "precision": _precision(precision, owner)}
    act = activation.fused_kwargs if activation is not None else {"activation": None}
    kernel = jnp.asarray(kernel, dt)
    if bn is None:
        y = functional.conv_bias_activation(x, kernel, bias, **conv_kwargs, **act)
    else:
        y = functional.conv_bias_batchnorm_activation(x, kernel, bias, *bn.filled(),
                                                      epsilon=bn.epsilon, **conv_kwargs, **act)
    y = jnp.reshape(y, (*batch_shape, *y.shape[1:]))
    return y.astype(out_dtype)


def feature_axis(ndim: int, axis: Any, owner: str) -> int:
    """The single feature axis of a batch norm over an `ndim`-D input."""
    if isinstance(axis, Sequence):
        if len(axis) != 1:
            raise ValueError(f"{owner} fuses batch norm over one feature axis, got axis={axis!r}")
        axis = axis[0]
    if not -ndim <= int(axis) < ndim:
        raise ValueError(f"{owner}: axis {axis} is out of range for a {ndim}-D input")
    return int(axis) % ndim


def batchnorm_activation(x: Any, bn: BatchNormParams, axis: int, *, compute_dtype: Any,
                         out_dtype: Any, activation: Activation | None,
                         owner: str) -> jax.Array:
    """``activation(bn(x))`` with running statistics over feature axis `axis`, in one pass."""
    dt = _compute_dtype(compute_dtype, owner)
    shape = x.shape
    if x.ndim == 4 and axis == 3:
        view, layout = x, "NHWC"
    else:
        # A free reshape puts the feature axis second: an NCHW tensor to the fused op.
        view = jnp.reshape(x, (math.prod(shape[:axis]), shape[axis],
                               math.prod(shape[axis + 1:]), 1))
        layout = "NCHW"
    act = activation.fused_kwargs if activation is not None else {"activation": None}
    y = functional.batchnorm_activation(view.astype(dt), *bn.filled(), epsilon=bn.epsilon,
                                        layout=layout, **act)
    return jnp.reshape(y, shape).astype(out_dtype)
