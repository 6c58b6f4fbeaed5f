"""Fusion plans as functions of named operands, and an independent jax.nn reference, for the
transformation tests (grad, vmap, sharding, export).

`named_operands` draws the operands of a :class:`cases.Case` (through ``Case.random_args``) as
a dict of arrays, scalars included, so tests can differentiate, vmap or shard any of them;
`execute` runs the plan on such a dict and `nn_reference` computes the same chain with
``lax.conv_general_dilated`` and jax.nn activations (jax.nn's derivative conventions).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from cases import Case
from jax import lax

import jaxfuse as jf
from jaxfuse.activations import ActivationMode, activation_mode

# The named operands of each operator, arrays first, as OperatorArgs' setters take them.
PARAMS = {
    "C": ("w", "conv_alpha"),
    "B": ("bias",),
    "N": ("scale", "shift", "mean", "var", "epsilon"),
    "S": ("side", "side_alpha"),
    "A": ("act_alpha", "act_beta", "act_gamma"),
}
_SCALAR_KEYS = {"conv_alpha": "conv_alpha", "epsilon": "bn_epsilon", "side_alpha": "side_alpha",
                "act_alpha": "act_alpha", "act_beta": "act_beta", "act_gamma": "act_gamma"}


def build(case: Case, seed: int = 0) -> tuple[jf.FusionPlan, dict[str, Any], Any,
                                               dict[str, jax.Array]]:
    """A compiled plan, its operator handles, and random x and named operands."""
    plan, handles = case.build()
    plan.compile()
    x, params = named_operands(case, plan, handles, np.random.default_rng(seed))
    return plan, handles, x, params


def named_operands(case: Case, plan: jf.FusionPlan, handles: dict[str, Any],
                   rng: np.random.Generator) -> tuple[Any, dict[str, jax.Array]]:
    """Random x and the plan's operands by name (scalars as float32 arrays)."""
    x, args, _ = case.random_args(plan, handles, rng)
    params: dict[str, jax.Array] = {}
    for letter in case.ops:
        entry = args.entry(handles[letter])
        scalars = dict(entry.scalars)
        names = PARAMS[letter]
        arrays = names[:len(entry.arrays)]
        params.update({n: jnp.asarray(a) for n, a in zip(arrays, entry.arrays)})
        for name in names[len(entry.arrays):]:
            params[name] = jnp.asarray(scalars[_SCALAR_KEYS[name]], jnp.float32)
    return x, params


def execute(plan: jf.FusionPlan, handles: dict[str, Any], x: Any,
            params: dict[str, Any]) -> jax.Array:
    """``plan.execute`` with OperatorArgs built from named operands."""
    args = jf.OperatorArgs()
    p = params
    for letter, op in handles.items():
        if letter == "C":
            args.set_conv_forward(op, p["w"], alpha=p["conv_alpha"])
        elif letter == "B":
            args.set_bias_forward(op, p["bias"])
        elif letter == "N":
            args.set_batchnorm_inference(op, p["scale"], p["shift"], p["mean"], p["var"],
                                         epsilon=p["epsilon"])
        elif letter == "S":
            args.set_side_input_add(op, p["side"], alpha=p["side_alpha"])
        elif letter == "A":
            args.set_activation_forward(op, p["act_alpha"], p["act_beta"], p["act_gamma"])
    return plan.execute(x, args)


def nn_activation(mode: str, y: Any, a: Any, b: Any, g: Any) -> Any:
    """The activation written with jax.nn wherever it has the function."""
    mode = activation_mode(mode)
    if mode is ActivationMode.PASSTHRU:
        return y
    if mode is ActivationMode.LOGISTIC:
        return jax.nn.sigmoid(y)
    if mode is ActivationMode.TANH:
        return b * jnp.tanh(a * y)
    if mode is ActivationMode.RELU:
        return jax.nn.relu(y)
    if mode is ActivationMode.SOFTRELU:
        return jax.nn.softplus(y)
    if mode is ActivationMode.ABS:
        return jnp.abs(y)
    if mode is ActivationMode.POWER:
        base = a + b * y
        positive = base > 0
        return jnp.where(positive, jnp.where(positive, base, 1.0) ** g, 0.0)
    if mode is ActivationMode.CLIPPED_RELU:  # min(max(y, 0), a) as a rescaled relu6 (a > 0)
        return a / 6 * jax.nn.relu6(6 * y / a)
    if mode is ActivationMode.LEAKY_RELU:
        return jax.nn.leaky_relu(y, a)
    if mode is ActivationMode.ELU:
        return jax.nn.elu(y, a)
    if mode is ActivationMode.SILU:
        return jax.nn.silu(y)
    if mode is ActivationMode.GELU:
        return jax.nn.gelu(y, approximate=False)
    if mode is ActivationMode.GELU_TANH:
        return jax.nn.gelu(y, approximate=True)
    if mode is ActivationMode.HARDSWISH:
        return jax.nn.hard_swish(y)
    if mode is ActivationMode.HARDSIGMOID:
        return jax.nn.hard_sigmoid(y)
    if mode is ActivationMode.MISH:
        return jax.nn.mish(y)
    raise AssertionError(mode)


def nn_reference(case: Case, x: Any, params: dict[str, Any]) -> jax.Array:
    """The chain in jax: exact float32 conv, float32 epilogue in the plan's layout."""
    p = params
    channel_last = case.layout == "NHWC"

    def per_channel(v: Any) -> Any:  # (K,) broadcast along the layout's channel axis
        v = jnp.asarray(v, jnp.float32)
        return v if channel_last else v[:, None, None]

    def bn_param(v: Any) -> Any:  # per-activation parameters already have the sample's shape
        return jnp.asarray(v, jnp.float32) if case.bn_mode == "per_activation" \
            else per_channel(v)

    y = x
    for letter in case.ops:
        if letter == "C":
            y = lax.conv_general_dilated(
                jnp.asarray(y, jnp.float32), jnp.asarray(p["w"], jnp.float32), case.strides,
                case.padding, rhs_dilation=case.dilation,
                dimension_numbers=(case.layout, case.filter_layout, case.layout),
                feature_group_count=case.groups, precision=lax.Precision.HIGHEST)
            y = y * p["conv_alpha"]
        y = jnp.asarray(y, jnp.float32)
        if letter == "B":
            y = y + per_channel(p["bias"])
        elif letter == "N":
            scale, shift, mean, var = (bn_param(p[k]) for k in ("scale", "shift", "mean", "var"))
            y = (y - mean) * (scale / jnp.sqrt(var + p["epsilon"])) + shift
        elif letter == "S":
            y = y + p["side_alpha"] * jnp.asarray(p["side"], jnp.float32)
        elif letter == "A":
            y = nn_activation(case.activation, y, p["act_alpha"], p["act_beta"],
                              p["act_gamma"])
    return y.astype(case.dtype)


def relative_tree_error(out: Any, ref: Any) -> float:
    """The largest relative L2 error over matching leaves of two pytrees.

    A leaf's error is relative to its reference's norm, or absolute when that norm is below 1:
    scalar gradients (of conv alpha, epsilon, ...) are sums whose terms can cancel to almost
    nothing, leaving only rounding to compare.
    """
    errors = []
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref),
                    strict=True):
        o = np.asarray(jnp.asarray(o, jnp.float32), np.float64)
        r = np.asarray(jnp.asarray(r, jnp.float32), np.float64)
        assert o.shape == r.shape, (o.shape, r.shape)
        assert np.isfinite(o).all(), "non-finite values"
        errors.append(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1.0))
    return float(max(errors))
