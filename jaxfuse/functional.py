"""A `lax`-style functional API: fused ops without building plans by hand.

Each call builds (once per static configuration) and compiles a :class:`FusionPlan`, then
executes it; shapes, dtypes and geometry are the memo key, arrays and scalars are runtime
arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .activations import ActivationMode
from .args import OperatorArgs
from .descriptors import ConvDesc, Padding, TensorDesc
from .plan import FusionPlan

__all__ = [
    "batchnorm_activation",
    "bias_activation",
    "conv_batchnorm_activation",
    "conv_bias_activation",
    "conv_bias_batchnorm_activation",
]

DimensionNumbers = Any  # a (lhs, rhs, out) tuple of layout strings, or lax.ConvDimensionNumbers


def _layouts(dimension_numbers: DimensionNumbers) -> tuple[str, str]:
    if dimension_numbers is None:
        return "NCHW", "OIHW"
    if hasattr(dimension_numbers, "lhs_spec"):  # lax.ConvDimensionNumbers
        specs = (dimension_numbers.lhs_spec, dimension_numbers.rhs_spec,
                 dimension_numbers.out_spec)
        lhs = {(0, 1, 2, 3): "NCHW", (0, 3, 1, 2): "NHWC"}.get(tuple(specs[0]))
        rhs = {(0, 1, 2, 3): "OIHW", (3, 2, 0, 1): "HWIO", (0, 3, 1, 2): "OHWI"}.get(
            tuple(specs[1]))
        out = {(0, 1, 2, 3): "NCHW", (0, 3, 1, 2): "NHWC"}.get(tuple(specs[2]))
    else:
        lhs, rhs, out = (str(s).upper() for s in dimension_numbers)
    if lhs not in ("NCHW", "NHWC") or out != lhs or rhs not in ("OIHW", "HWIO", "OHWI"):
        raise ValueError(f"dimension_numbers {dimension_numbers!r} not supported: the input and "
                         "output must both be NCHW or both NHWC, the filter OIHW, HWIO or OHWI")
    return lhs, rhs


def _static_padding(padding: Padding) -> Any:
    if isinstance(padding, str):
        return padding
    if isinstance(padding, (int, np.integer)):
        return int(padding)
    return tuple(p if isinstance(p, (int, np.integer)) else tuple(p) for p in padding)


@functools.lru_cache(maxsize=1024)
def _plan(x_desc: TensorDesc, w_desc: TensorDesc | None, conv: ConvDesc | None, ops: str,
          bn_mode: str, activation: str | None) -> tuple[FusionPlan, tuple[Any, ...]]:
    plan = FusionPlan(x_desc)
    handles: list[Any] = []
    for letter in ops:
        if letter == "C":
            handles.append(plan.add_conv_forward(conv, w_desc))
        elif letter == "B":
            # A bias first in the chain (no conv before it) has the input's channels.
            channels = (plan.output_desc if plan.ops else x_desc).dim("C")
            handles.append(plan.add_bias_forward(TensorDesc((channels,), np.float32)))
        elif letter == "N":
            handles.append(plan.add_batchnorm_inference(bn_mode))
        elif letter == "S":
            handles.append(plan.add_side_input_add())
        elif letter == "A":
            handles.append(plan.add_activation_forward(activation))
    plan.compile()
    return plan, tuple(handles)


def _run(x: Any, *, w: Any = None, conv: ConvDesc | None = None, filter_layout: str = "OIHW",
         layout: str = "NCHW", bias: Any = None, bn: tuple[Any, ...] | None = None,
         epsilon: Any = 1e-5, bn_mode: str = "spatial", side: Any = None,
         side_alpha: Any = 1.0, activation: str | ActivationMode | None = None,
         activation_params: tuple[Any, Any, Any] = (None, None, None)) -> jax.Array:
    ops = ("C" if w is not None else "") + ("B" if bias is not None else "") + \
          ("N" if bn is not None else "") + ("S" if side is not None else "") + \
          ("A" if activation is not None else "")
    x_desc = TensorDesc.like(x, layout)
    w_desc = TensorDesc.like(w, filter_layout) if w is not None else None
    act = None if activation is None else str(ActivationMode(activation) if isinstance(
        activation, ActivationMode) else activation)
    plan, handles = _plan(x_desc, w_desc, conv, ops, bn_mode, act)
    args = OperatorArgs()
    for letter, op in zip(ops, handles):
        if letter == "C":
            args.set_conv_forward(op, w)
        elif letter == "B":
            args.set_bias_forward(op, bias)
        elif letter == "N":
            args.set_batchnorm_inference(op, *bn, epsilon=epsilon)
        elif letter == "S":
            args.set_side_input_add(op, side, alpha=side_alpha)
        elif letter == "A":
            args.set_activation_forward(op, *activation_params)
    return plan.execute(x, args)


def conv_bias_activation(
        x: Any, w: Any, b: Any = None, *, window_strides: Sequence[int] = (1, 1),
        padding: Padding = "VALID", rhs_dilation: Sequence[int] = (1, 1),
        feature_group_count: int = 1, dimension_numbers: DimensionNumbers = None,
        activation: str | ActivationMode | None = "relu", activation_alpha: Any = None,
        activation_beta: Any = None, activation_gamma: Any = None, side_input: Any = None,
        side_input_alpha: Any = 1.0, precision: Any = None) -> jax.Array:
    """``activation(conv(x, w) + b [+ side_input_alpha * side_input])`` as one fused kernel.

    Arguments follow `lax.conv_general_dilated`; `b` (shape ``(K,)``), `side_input` and
    `activation` may be None to leave that step out.
    """
    layout, filter_layout = _layouts(dimension_numbers)
    conv = ConvDesc(tuple(window_strides), _static_padding(padding), tuple(rhs_dilation),
                    feature_group_count, None if precision is None else str(precision))
    return _run(x, w=w, conv=conv, filter_layout=filter_layout, layout=layout, bias=b,
                side=side_input, side_alpha=side_input_alpha, activation=activation,
                activation_params=(activation_alpha, activation_beta, activation_gamma))


def conv_bias_batchnorm_activation(
        x: Any, w: Any, b: Any, scale: Any, shift: Any, mean: Any, variance: Any, *,
        epsilon: Any = 1e-5, bn_mode: str = "spatial", window_strides: Sequence[int] = (1, 1),
        padding: Padding = "VALID", rhs_dilation: Sequence[int] = (1, 1),
        feature_group_count: int = 1, dimension_numbers: DimensionNumbers = None,
        activation: str | ActivationMode | None = "relu", activation_alpha: Any = None,
        activation_beta: Any = None, activation_gamma: Any = None, side_input: Any = None,
        side_input_alpha: Any = 1.0, precision: Any = None) -> jax.Array:
    """``activation(bn(conv(x, w) + b) [+ side_input])`` as one fused kernel (`b` may be None)."""
    layout, filter_layout = _layouts(dimension_numbers)
    conv = ConvDesc(tuple(window_strides), _static_padding(padding), tuple(rhs_dilation),
                    feature_group_count, None if precision is None else str(precision))
    return _run(x, w=w, conv=conv, filter_layout=filter_layout, layout=layout, bias=b,
                bn=(scale, shift, mean, variance), epsilon=epsilon, bn_mode=bn_mode,
                side=side_input, side_alpha=side_input_alpha, activation=activation,
                activation_params=(activation_alpha, activation_beta, activation_gamma))


def conv_batchnorm_activation(x: Any, w: Any, scale: Any, shift: Any, mean: Any, variance: Any,
                              **kwargs: Any) -> jax.Array:
    """``activation(bn(conv(x, w)))``: :func:`conv_bias_batchnorm_activation` without bias."""
    return conv_bias_batchnorm_activation(x, w, None, scale, shift, mean, variance, **kwargs)


def batchnorm_activation(
        x: Any, scale: Any, shift: Any, mean: Any, variance: Any, *, epsilon: Any = 1e-5,
        bn_mode: str = "spatial", layout: str = "NCHW",
        activation: str | ActivationMode | None = "relu", activation_alpha: Any = None,
        activation_beta: Any = None, activation_gamma: Any = None) -> jax.Array:
    """``activation(bn(x))`` in one pass (MIOpen's NA fusion)."""
    return _run(x, layout=layout, bn=(scale, shift, mean, variance), epsilon=epsilon,
                bn_mode=bn_mode, activation=activation,
                activation_params=(activation_alpha, activation_beta, activation_gamma))


def bias_activation(x: Any, b: Any, *, layout: str = "NCHW",
                    activation: str | ActivationMode | None = "relu",
                    activation_alpha: Any = None, activation_beta: Any = None,
                    activation_gamma: Any = None) -> jax.Array:
    """``activation(x + b)`` in one pass (the BA fusion)."""
    return _run(x, layout=layout, bias=b, activation=activation,
                activation_params=(activation_alpha, activation_beta, activation_gamma))
