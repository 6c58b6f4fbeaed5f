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
import jax.numpy as jnp
import numpy as np
from jax import lax

from .activations import ActivationMode
from .args import OperatorArgs
from .descriptors import ConvDesc, Padding, TensorDesc, canonical_dtype, lax_precision
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


def _check_2d(x: Any, w: Any, dimension_numbers: DimensionNumbers) -> None:
    """Only 2-D convolutions fuse; said first, so that a 1-D or 3-D convolution is not refused
    for its strides or padding."""
    ranks = [("x", np.ndim(x)), ("w", np.ndim(w))]
    specs = dimension_numbers
    if hasattr(dimension_numbers, "lhs_spec"):
        specs = (dimension_numbers.lhs_spec, dimension_numbers.rhs_spec,
                 dimension_numbers.out_spec)
    if isinstance(specs, (tuple, list)):
        ranks += [(f"dimension_numbers entry {spec!r}", len(spec)) for spec in specs
                  if isinstance(spec, (str, tuple, list))]
    for what, rank in ranks:
        if rank != 4:
            kind = f", as a {rank - 2}-D convolution's do" if rank > 2 else ""
            raise ValueError(f"only 2-D convolutions are supported (4-D x and w); {what} has "
                             f"{rank} dimensions{kind}")


def _pair(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name} must be a sequence of 2 ints (one per spatial dimension of a "
                        f"2-D convolution), got {value!r}")
    return tuple(value)


def _refuse_unsupported(lhs_dilation: Any, batch_group_count: Any, out_sharding: Any) -> None:
    """The arguments of lax.conv_general_dilated that have no fused form, by name."""
    if lhs_dilation is not None and _pair(lhs_dilation, "lhs_dilation") != (1, 1):
        raise ValueError(f"lhs_dilation={tuple(lhs_dilation)} (a transposed convolution) is not "
                         "supported; only lhs_dilation=None or (1, 1) fuses")
    if batch_group_count != 1:
        raise ValueError(f"batch_group_count={batch_group_count!r} is not supported; only 1 "
                         "fuses")
    if out_sharding is not None:
        raise ValueError("out_sharding is not supported; shard the operands (the fused op "
                         "follows their sharding under jax.jit)")


def _widen(x: Any, w: Any, preferred_element_type: Any) -> tuple[Any, Any]:
    """x and w in the dtype the result should have: float32 for float16/bfloat16 inputs is
    exact (as lax accumulates and returns it); any other change is refused."""
    if preferred_element_type is None:
        return x, w
    try:
        want = np.dtype(jnp.dtype(preferred_element_type))
    except TypeError as err:
        raise TypeError(f"preferred_element_type={preferred_element_type!r} is not a "
                        "dtype") from err
    have = np.dtype(x.dtype)
    if want == have:
        return x, w
    if want == np.float32 and have in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    raise ValueError(f"preferred_element_type={want.name} is not supported for {have.name} "
                     "inputs; the fused convolution returns the input dtype, or float32 for "
                     "float16/bfloat16 inputs")


def _as_jax(value: Any) -> Any:
    """`value` under JAX's dtype rules, as lax's functions take it: a NumPy float64 array (or
    a list) becomes float32 unless jax_enable_x64 is on; JAX arrays and tracers pass as is."""
    return value if value is None or isinstance(value, jax.Array) else jnp.asarray(value)


def _conv_call(x: Any, w: Any, window_strides: Any, padding: Padding, lhs_dilation: Any,
               rhs_dilation: Any, feature_group_count: Any, batch_group_count: Any,
               dimension_numbers: DimensionNumbers, precision: Any,
               preferred_element_type: Any, out_sharding: Any) -> tuple[Any, Any, dict]:
    """x, w and `_run`'s convolution keywords from `lax.conv_general_dilated`'s arguments."""
    x, w = _as_jax(x), _as_jax(w)
    _check_2d(x, w, dimension_numbers)
    _refuse_unsupported(lhs_dilation, batch_group_count, out_sharding)
    layout, filter_layout = _layouts(dimension_numbers)
    x, w = _widen(x, w, preferred_element_type)
    strides = _pair(window_strides, "window_strides")
    dilation = (1, 1) if rhs_dilation is None else _pair(rhs_dilation, "rhs_dilation")
    if isinstance(padding, str) and padding.upper() not in ("SAME", "SAME_LOWER", "VALID"):
        raise ValueError(f"padding {padding!r} is not supported; expected 'SAME', 'SAME_LOWER', "
                         "'VALID' or (low, high) pairs")
    lower = isinstance(padding, str) and padding.upper() == "SAME_LOWER"
    # (None: the caller's jax_default_matmul_precision, as lax reads it)
    conv = ConvDesc(strides, "VALID" if lower else _static_padding(padding), dilation,
                    feature_group_count, lax_precision(precision))
    if lower:  # resolved here, as lax does, from the input and filter sizes
        windows = [(np.shape(w)[filter_layout.index(a)] - 1) * d + 1
                   for a, d in zip("HW", conv.dilation)]
        in_hw = [np.shape(x)[layout.index(a)] for a in "HW"]
        conv = ConvDesc(conv.strides, lax.padtype_to_pads(in_hw, windows, conv.strides,
                                                          "SAME_LOWER"),
                        conv.dilation, conv.groups, conv.precision)
    return x, w, {"conv": conv, "layout": layout, "filter_layout": filter_layout}


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
    x, w, bias, side = _as_jax(x), _as_jax(w), _as_jax(bias), _as_jax(side)
    bn = None if bn is None else tuple(_as_jax(v) for v in bn)
    for name, array in (("x", x), ("w", w)):
        if array is not None:  # (named here: the plan's descriptor would say "TensorDesc")
            canonical_dtype(array.dtype, name)
    ops = ("C" if w is not None else "") + ("B" if bias is not None else "") + \
          ("N" if bn is not None else "") + ("S" if side is not None else "") + \
          ("A" if activation is not None else "")
    if activation is not None and not isinstance(activation, (str, ActivationMode)):
        raise TypeError(f"activation must be an activation mode name or a "
                        f"jaxfuse.ActivationMode, got {activation!r} (jaxfuse.flax's layers "
                        "take jax functions such as jax.nn.relu)")
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
        padding: Padding = "VALID", lhs_dilation: Sequence[int] | None = None,
        rhs_dilation: Sequence[int] | None = None, feature_group_count: int = 1,
        batch_group_count: int = 1, dimension_numbers: DimensionNumbers = None,
        activation: str | ActivationMode | None = "relu", activation_alpha: Any = None,
        activation_beta: Any = None, activation_gamma: Any = None, side_input: Any = None,
        side_input_alpha: Any = 1.0, precision: Any = None, preferred_element_type: Any = None,
        out_sharding: Any = None) -> jax.Array:
    """``activation(conv(x, w) + b [+ side_input_alpha * side_input])`` as one fused kernel.

    The convolution's arguments are `lax.conv_general_dilated`'s, for 2-D convolutions:
    `padding` "SAME", "SAME_LOWER", "VALID" or (low, high) pairs; `precision` a lax precision
    or an (lhs, rhs) pair (the stricter decides whether fp32 may use TF32);
    `preferred_element_type` None, the input dtype, or float32 for float16/bfloat16 inputs
    (widened exactly, so the fused op runs in float32). `lhs_dilation` other than 1,
    `batch_group_count` other than 1 and `out_sharding` are refused by name. `b` (shape
    ``(K,)``), `side_input` and `activation` may be None to leave that step out.

    >>> import jax.numpy as jnp, jaxfuse as jf
    >>> x, w, b = jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 16)), jnp.zeros(16)
    >>> jf.conv_bias_activation(x, w, b, padding="SAME",
    ...                         dimension_numbers=("NHWC", "HWIO", "NHWC")).shape
    (1, 8, 8, 16)
    """
    x, w, conv = _conv_call(x, w, window_strides, padding, lhs_dilation, rhs_dilation,
                            feature_group_count, batch_group_count, dimension_numbers,
                            precision, preferred_element_type, out_sharding)
    return _run(x, w=w, **conv, bias=b, side=side_input, side_alpha=side_input_alpha,
                activation=activation,
                activation_params=(activation_alpha, activation_beta, activation_gamma))


def conv_bias_batchnorm_activation(
        x: Any, w: Any, b: Any, scale: Any, shift: Any, mean: Any, variance: Any, *,
        epsilon: Any = 1e-5, bn_mode: str = "spatial", window_strides: Sequence[int] = (1, 1),
        padding: Padding = "VALID", lhs_dilation: Sequence[int] | None = None,
        rhs_dilation: Sequence[int] | None = None, feature_group_count: int = 1,
        batch_group_count: int = 1, dimension_numbers: DimensionNumbers = None,
        activation: str | ActivationMode | None = "relu", activation_alpha: Any = None,
        activation_beta: Any = None, activation_gamma: Any = None, side_input: Any = None,
        side_input_alpha: Any = 1.0, precision: Any = None, preferred_element_type: Any = None,
        out_sharding: Any = None) -> jax.Array:
    """``activation(bn(conv(x, w) + b) [+ side_input])`` as one fused kernel (`b` may be None).

    The convolution's arguments are as in :func:`conv_bias_activation`.
    """
    x, w, conv = _conv_call(x, w, window_strides, padding, lhs_dilation, rhs_dilation,
                            feature_group_count, batch_group_count, dimension_numbers,
                            precision, preferred_element_type, out_sharding)
    return _run(x, w=w, **conv, bias=b, bn=(scale, shift, mean, variance), epsilon=epsilon,
                bn_mode=bn_mode, side=side_input, side_alpha=side_input_alpha,
                activation=activation,
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
