"""Tensor and convolution descriptors: the static facts a fusion plan is specialized on."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "DATA_LAYOUTS",
    "FILTER_LAYOUTS",
    "SUPPORTED_DTYPES",
    "ConvDesc",
    "Padding",
    "TensorDesc",
    "canonical_dtype",
    "dtype_code",
]

DATA_LAYOUTS = ("NCHW", "NHWC")
FILTER_LAYOUTS = ("OIHW", "HWIO", "OHWI")
SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_DTYPE_CODES = {np.dtype(jnp.float32): "f32", np.dtype(jnp.float16): "f16",
                np.dtype(jnp.bfloat16): "bf16"}
# MIOpen describes filters with data layouts; map them onto the filter layout they mean.
_FILTER_ALIASES = {"NCHW": "OIHW", "NHWC": "OHWI"}

Padding = str | int | Sequence[int] | Sequence[Sequence[int]]


def canonical_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
    """Returns `dtype` as a numpy dtype, raising TypeError unless it is fp32, fp16 or bf16."""
    try:
        dt = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"{what}: {dtype!r} is not a dtype") from err
    if dt not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what}: {dt.name} is not supported; expected one of {names}")
    return dt


def dtype_code(dtype: np.dtype) -> str:
    """The short name the C++ side uses for a supported dtype."""
    return _DTYPE_CODES[np.dtype(dtype)]


def _as_int(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError as err:
        raise TypeError(f"{what} must be an integer, got {value!r}") from err


def _int_pair(value: Any, what: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)):
        value = (value, value)
    if not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{what} must be an int or a pair of ints, got {value!r}")
    pair = (_as_int(value[0], what), _as_int(value[1], what))
    if min(pair) < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {pair}")
    return pair


@dataclasses.dataclass(frozen=True, init=False)
class TensorDesc:
    """Shape, dtype and layout of a tensor.

    Data tensors are 4-D in layout ``"NCHW"`` or ``"NHWC"``; filters are 4-D in ``"OIHW"``,
    ``"HWIO"`` or ``"OHWI"`` (``"NCHW"``/``"NHWC"`` are accepted for filters, as MIOpen does, and
    mean ``"OIHW"``/``"OHWI"``); bias and batch-norm parameters are 1-D or 3-D.

    >>> TensorDesc((8, 64, 56, 56), "float16").layout
    'NCHW'
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    layout: str

    def __init__(self, shape: Sequence[int], dtype: Any, layout: str | None = None):
        if isinstance(shape, (int, np.integer)) or not isinstance(shape, Sequence):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
        dims = tuple(_as_int(d, "shape entry") for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shape {dims} has a negative dimension")
        if layout is None:
            layout = "NCHW" if len(dims) == 4 else ""
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a string, got {layout!r}")
        layout = layout.upper()
        if layout in DATA_LAYOUTS + FILTER_LAYOUTS and len(dims) != len(layout):
            raise ValueError(f"shape {dims} has {len(dims)} dimensions; layout {layout!r} "
                             f"describes {len(layout)}-D tensors")
        if layout and layout not in DATA_LAYOUTS + FILTER_LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {DATA_LAYOUTS + FILTER_LAYOUTS}")
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", canonical_dtype(dtype, "TensorDesc dtype"))
        object.__setattr__(self, "layout", layout)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self, axis: str) -> int:
        """The size of the axis named `axis` (one letter of the layout)."""
        return self.shape[self.layout.index(axis)]

    def matches(self, array: Any) -> bool:
        return tuple(np.shape(array)) == self.shape and np.dtype(array.dtype) == self.dtype

    @classmethod
    def like(cls, array: Any, layout: str | None = None) -> TensorDesc:
        """A descriptor with the shape and dtype of `array`."""
        return cls(np.shape(array), array.dtype, layout)


def filter_layout(desc: TensorDesc) -> str:
    """The filter layout `desc` means, resolving MIOpen's data-layout aliases."""
    return _FILTER_ALIASES.get(desc.layout, desc.layout)


@dataclasses.dataclass(frozen=True, init=False)
class ConvDesc:
    """Convolution geometry with `lax.conv_general_dilated` semantics.

    Args:
      strides: window strides ``(sh, sw)`` or one int.
      padding: ``"SAME"``, ``"VALID"``, ``((pt, pb), (pl, pr))``, ``(ph, pw)`` or one int.
        Negative padding crops, as in lax.
      dilation: filter (rhs) dilation.
      groups: ``feature_group_count``; ``groups == C == K`` is a depthwise convolution.
      precision: ``None`` lets fp32 convolutions use TF32 on GPUs, as lax's default precision
        does; ``"highest"`` asks for exact fp32. Any lax precision is accepted (a
        ``lax.Precision`` or its name, a ``lax.DotAlgorithmPreset``, or an ``(lhs, rhs)``
        pair, which follows its stricter member) and kept as one of these two. (jaxfuse's
        functions and Flax layers read ``jax_default_matmul_precision`` for None, as lax does.)
    """

    strides: tuple[int, int]
    padding: str | tuple[tuple[int, int], tuple[int, int]]
    dilation: tuple[int, int]
    groups: int
    precision: str | None

    def __init__(self, strides: int | Sequence[int] = (1, 1), padding: Padding = ((0, 0), (0, 0)),
                 dilation: int | Sequence[int] = (1, 1), groups: int = 1,
                 precision: str | None = None):
        object.__setattr__(self, "strides", _int_pair(strides, "strides", 1))
        object.__setattr__(self, "dilation", _int_pair(dilation, "dilation", 1))
        object.__setattr__(self, "padding", _canonical_padding(padding))
        groups = _as_int(groups, "groups")
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "precision", _canonical_precision(precision))

    def explicit_padding(self, in_hw: tuple[int, int],
                         filter_hw: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """Resolves "SAME"/"VALID" against an input and filter size, as lax does."""
        if not isinstance(self.padding, str):
            return self.padding
        if self.padding == "VALID":
            return ((0, 0), (0, 0))
        pads = []
        for size, window, stride, dil in zip(in_hw, filter_hw, self.strides, self.dilation):
            effective = (window - 1) * dil + 1
            out = -(-size // stride)
            total = max((out - 1) * stride + effective - size, 0)
            pads.append((total // 2, total - total // 2))
        return (pads[0], pads[1])

    def output_hw(self, in_hw: tuple[int, int], filter_hw: tuple[int, int]) -> tuple[int, int]:
        """Output height and width (may be <= 0 for impossible geometry; callers check)."""
        pads = self.explicit_padding(in_hw, filter_hw)
        out = []
        for size, window, stride, dil, (lo, hi) in zip(
                in_hw, filter_hw, self.strides, self.dilation, pads):
            effective = (window - 1) * dil + 1
            span = size + lo + hi - effective
            out.append(span // stride + 1 if span >= 0 else 0)
        return (out[0], out[1])


# lax's precision names (case aside), by level: 0 DEFAULT (TF32 allowed), 1 HIGH, 2 HIGHEST.
# jaxfuse has one exact fp32 mode, so HIGH gets it too, as in jaxfuse.fuse.
_PRECISION_LEVELS = {"default": 0, "fastest": 0, "bfloat16": 0, "high": 1, "bfloat16_3x": 1,
                     "tensorfloat32": 1, "highest": 2, "float32": 2}
# ... and lax.DotAlgorithmPreset's (jax_default_matmul_precision may name one): lax lowers a
# convolution given one at DEFAULT precision (jax._src.lax.lax._full_precision), TF32 and all.
_PRECISION_LEVELS.update({preset.name.lower(): 0 for preset in lax.DotAlgorithmPreset})


def lax_precision(precision: Any) -> Any:
    """The precision `lax.conv_general_dilated` would use for `precision`: None is the
    caller's ``jax_default_matmul_precision`` (``jax.default_matmul_precision(...)``, read in
    this thread, as lax reads it when a function is traced)."""
    return jax.config.jax_default_matmul_precision if precision is None else precision


def _canonical_precision(precision: Any) -> str | None:
    """"highest" when `precision` (a lax precision or an (lhs, rhs) pair, which follows its
    stricter member) asks for more than the default, else None."""
    if precision is None:
        return None
    pair = isinstance(precision, (tuple, list))
    values = tuple(precision) if pair else (precision,)
    names = [str(getattr(v, "name", v)).lower().removeprefix("precision.") for v in values]
    if (pair and len(values) != 2) or any(v is None or isinstance(v, (tuple, list))
                                          for v in values) or \
            not all(name in _PRECISION_LEVELS for name in names):
        raise ValueError(
            f"precision {precision!r} is not a lax precision: expected None, a lax.Precision "
            "or its name, a lax.DotAlgorithmPreset, or an (lhs, rhs) pair of them")
    return "highest" if max(_PRECISION_LEVELS[name] for name in names) > 0 else None


def _canonical_padding(padding: Padding) -> str | tuple[tuple[int, int], tuple[int, int]]:
    if isinstance(padding, str):
        mode = padding.upper()
        if mode not in ("SAME", "VALID"):
            raise ValueError(f"padding string must be 'SAME' or 'VALID', got {padding!r}")
        return mode
    if isinstance(padding, (int, np.integer)):
        p = _as_int(padding, "padding")
        return ((p, p), (p, p))
    if not isinstance(padding, Sequence) or len(padding) != 2:
        raise ValueError(
            f"padding must be 'SAME', 'VALID', an int, (ph, pw) or ((pt, pb), (pl, pr)); "
            f"got {padding!r}")
    pairs = []
    for entry in padding:
        if isinstance(entry, (int, np.integer)):
            p = _as_int(entry, "padding")
            pairs.append((p, p))
        elif isinstance(entry, Sequence) and len(entry) == 2:
            pairs.append((_as_int(entry[0], "padding"), _as_int(entry[1], "padding")))
        else:
            raise ValueError(f"padding entry {entry!r} must be an int or a (low, high) pair")
    return (pairs[0], pairs[1])


DataLayout = Literal["NCHW", "NHWC"]
FilterLayout = Literal["OIHW", "HWIO", "OHWI"]
