"""The static, hashable description of a compiled plan: what kernels are specialized on.

A :class:`PlanSignature` is the primitive's only parameter and travels to C++ as one string
attribute (``encode()``), so an exported program carries everything its handler needs.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from .activations import ActivationMode
from .descriptors import dtype_code

__all__ = ["SCALARS", "ConvSpec", "OperandSpec", "PlanSignature"]

# Runtime scalars travel in one float32 operand, in this order (csrc/common/plan_spec.h agrees).
SCALARS = ("conv_alpha", "bn_epsilon", "act_alpha", "act_beta", "act_gamma", "side_alpha",
           "reserved0", "reserved1")

OP_LETTERS = {"conv": "C", "bias": "B", "batchnorm": "N", "side_add": "S", "activation": "A"}


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """Resolved convolution geometry (explicit padding, filter sizes)."""

    out_channels: int
    filter_h: int
    filter_w: int
    filter_layout: str
    strides: tuple[int, int]
    padding: tuple[tuple[int, int], tuple[int, int]]
    dilation: tuple[int, int]
    groups: int
    allow_tf32: bool
    # float32 filters of a float16/bfloat16 plan, rounded to the plan's dtype as the kernel
    # loads them; None: filters in the plan's dtype.
    filter_dtype: np.dtype | None = None


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """One array operand of the fused primitive."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class PlanSignature:
    """Everything a fused kernel is specialized on. Shapes are logical (N, C, H, W)."""

    dtype: np.dtype
    layout: str
    batch: int
    channels: int
    height: int
    width: int
    ops: str  # letters in execution order, e.g. "CBNA"
    conv: ConvSpec | None = None
    bn_mode: str | None = None
    activation: ActivationMode | None = None
    # The output's layout where it is not the input's (None: the input's). Plans always have
    # one layout; this is a kernel form (jaxfuse.solvers.kernel_forms): NCHW plans on Hopper
    # can run a kernel that reads their input transposed to NHWC and writes NCHW itself.
    output_layout: str | None = None

    def __post_init__(self) -> None:
        # One spelling of each signature: equal ones must hash equal (compile caches).
        if self.output_layout == self.layout:
            object.__setattr__(self, "output_layout", None)
        if self.output_layout not in (None, "NCHW", "NHWC"):
            raise ValueError(f"output_layout must be NCHW or NHWC, not {self.output_layout!r}")

    @property
    def out_layout(self) -> str:
        """The layout of the output, the side input and per-activation parameters."""
        return self.output_layout or self.layout

    # ----- derived shapes ---------------------------------------------------------------------
    @cached_property
    def output_chw(self) -> tuple[int, int, int]:
        if self.conv is None:
            return (self.channels, self.height, self.width)
        c = self.conv
        hw = []
        for size, window, stride, dil, (lo, hi) in zip(
                (self.height, self.width), (c.filter_h, c.filter_w), c.strides, c.dilation,
                c.padding):
            hw.append((size + lo + hi - (window - 1) * dil - 1) // stride + 1)
        return (c.out_channels, hw[0], hw[1])

    def physical(self, n: int, c: int, h: int, w: int, layout: str | None = None
                 ) -> tuple[int, ...]:
        """(n, c, h, w) in `layout`'s order (default: the input's layout)."""
        return (n, c, h, w) if (layout or self.layout) == "NCHW" else (n, h, w, c)

    @cached_property
    def input_shape(self) -> tuple[int, ...]:
        return self.physical(self.batch, self.channels, self.height, self.width)

    @cached_property
    def output_shape(self) -> tuple[int, ...]:
        return self.physical(self.batch, *self.output_chw, layout=self.out_layout)

    @cached_property
    def filter_shape(self) -> tuple[int, ...]:
        c = self.conv
        assert c is not None
        o, i, h, w = c.out_channels, self.channels // c.groups, c.filter_h, c.filter_w
        return {"OIHW": (o, i, h, w), "HWIO": (h, w, i, o), "OHWI": (o, h, w, i)}[c.filter_layout]

    @property
    def filter_dtype(self) -> np.dtype:
        """The filters' dtype: the plan's, or float32 (see ConvSpec.filter_dtype)."""
        c = self.conv
        return self.dtype if c is None or c.filter_dtype is None else np.dtype(c.filter_dtype)

    @cached_property
    def param_shape(self) -> dict[str, tuple[int, ...]]:
        """Shapes of bias and batch-norm parameters."""
        k, h, w = self.output_chw
        per_sample = (k, h, w) if self.out_layout == "NCHW" else (h, w, k)
        bn = per_sample if self.bn_mode == "per_activation" else (k,)
        return {"bias": (k,), "batchnorm": bn}

    @cached_property
    def operands(self) -> tuple[OperandSpec, ...]:
        """The primitive's operands, in order (x first, the scalars last)."""
        f32 = np.dtype(np.float32)
        specs = [OperandSpec("x", self.input_shape, self.dtype)]
        for letter in self.ops:
            if letter == "C":
                specs.append(OperandSpec("w", self.filter_shape, self.filter_dtype))
            elif letter == "B":
                specs.append(OperandSpec("bias", self.param_shape["bias"], f32))
            elif letter == "N":
                shape = self.param_shape["batchnorm"]
                specs += [OperandSpec(n, shape, f32) for n in ("scale", "shift", "mean", "var")]
            elif letter == "S":
                specs.append(OperandSpec("side", self.output_shape, self.dtype))
        specs.append(OperandSpec("scalars", (len(SCALARS),), f32))
        return tuple(specs)

    @property
    def flops(self) -> int:
        """Multiply-adds of the convolution counted as two flops (0 without a conv)."""
        if self.conv is None:
            return 0
        k, oh, ow = self.output_chw
        per_out = (self.channels // self.conv.groups) * self.conv.filter_h * self.conv.filter_w
        return 2 * self.batch * k * oh * ow * per_out

    # ----- the string the C++ side parses -----------------------------------------------------
    def encode(self) -> str:
        """Serializes the signature for the FFI handler (``csrc/common/plan_spec.cc``)."""
        parts = [
            "jaxfuse1",
            f"dtype={dtype_code(self.dtype)}",
            f"layout={self.layout}",
            *([f"olayout={self.out_layout}"] if self.out_layout != self.layout else []),
            f"in={self.batch},{self.channels},{self.height},{self.width}",
            f"ops={self.ops}",
        ]
        if self.conv is not None:
            c = self.conv
            (pt, pb), (pl, pr) = c.padding
            parts.append(
                f"conv={c.out_channels},{c.filter_h},{c.filter_w},{c.strides[0]},{c.strides[1]},"
                f"{pt},{pb},{pl},{pr},{c.dilation[0]},{c.dilation[1]},{c.groups},"
                f"{c.filter_layout},{int(c.allow_tf32)}")
            if self.filter_dtype != self.dtype:
                parts.append(f"wdtype={dtype_code(self.filter_dtype)}")
        if self.bn_mode is not None:
            parts.append(f"bn={self.bn_mode}")
        if self.activation is not None:
            parts.append(f"act={self.activation.code}")
        return ";".join(parts)

    def describe(self) -> str:
        """A short human-readable name, e.g. ``CBNA relu f16 NHWC 8x64x56x56 3x3/1``."""
        geom = ""
        if self.conv is not None:
            c = self.conv
            geom = f" {c.filter_h}x{c.filter_w}/{c.strides[0]} ->{c.out_channels}"
            if c.groups > 1:
                geom += f" g{c.groups}"
            if self.filter_dtype != self.dtype:
                geom += f" w:{self.filter_dtype.name}"
        act = f" {self.activation.value}" if self.activation is not None else ""
        layout = (self.layout if self.out_layout == self.layout
                  else f"{self.layout}>{self.out_layout}")
        return (f"{self.ops}{act} {self.dtype.name} {layout} "
                f"{self.batch}x{self.channels}x{self.height}x{self.width}{geom}")
