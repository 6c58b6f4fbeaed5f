"""Activation modes of the fusion API and their reference formulas.

The first ten are MIOpen's (``y = f(x; alpha, beta, gamma)``), numbered as
``miopenActivationMode_t``; the modes after them (silu, gelu, ...) are jax.nn's and take no
parameters. The C++ epilogue (``csrc/kernels/epilogue.h``) numbers them the same way.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEFAULT_PARAMS", "ActivationMode", "activation_mode", "jax_activation",
           "reference_activation"]


class ActivationMode(enum.StrEnum):
    """The activation modes a plan's activation operator can take."""

    PASSTHRU = "passthru"
    LOGISTIC = "logistic"
    TANH = "tanh"
    RELU = "relu"
    SOFTRELU = "softrelu"
    ABS = "abs"
    POWER = "power"
    CLIPPED_RELU = "clipped_relu"
    LEAKY_RELU = "leaky_relu"
    ELU = "elu"
    # Beyond MIOpen (appended, so the codes above keep their numbers).
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    HARDSWISH = "hardswish"
    HARDSIGMOID = "hardsigmoid"
    MISH = "mish"

    @property
    def code(self) -> int:
        """The integer the C++ epilogue switches on."""
        return _CODES[self]


_CODES = {mode: i for i, mode in enumerate(ActivationMode)}
_ALIASES = {"identity": "passthru", "sigmoid": "logistic", "softplus": "softrelu",
            "clippedrelu": "clipped_relu", "leakyrelu": "leaky_relu", "pasthru": "passthru",
            "swish": "silu", "gelutanh": "gelu_tanh", "hardsilu": "hardswish",
            "hard_swish": "hardswish", "hard_silu": "hardswish", "hard_sigmoid": "hardsigmoid"}

# (alpha, beta, gamma) used when the caller does not set them: the value that makes each mode
# mean what its common name says (tanh with unit scales, leaky relu with jax.nn's slope, ...).
DEFAULT_PARAMS: dict[ActivationMode, tuple[float, float, float]] = {
    ActivationMode.PASSTHRU: (0.0, 0.0, 0.0),
    ActivationMode.LOGISTIC: (0.0, 0.0, 0.0),
    ActivationMode.TANH: (1.0, 1.0, 0.0),
    ActivationMode.RELU: (0.0, 0.0, 0.0),
    ActivationMode.SOFTRELU: (0.0, 0.0, 0.0),
    ActivationMode.ABS: (0.0, 0.0, 0.0),
    ActivationMode.POWER: (0.0, 1.0, 1.0),
    ActivationMode.CLIPPED_RELU: (6.0, 0.0, 0.0),
    ActivationMode.LEAKY_RELU: (0.01, 0.0, 0.0),
    ActivationMode.ELU: (1.0, 0.0, 0.0),
    ActivationMode.SILU: (0.0, 0.0, 0.0),
    ActivationMode.GELU: (0.0, 0.0, 0.0),
    ActivationMode.GELU_TANH: (0.0, 0.0, 0.0),
    ActivationMode.HARDSWISH: (0.0, 0.0, 0.0),
    ActivationMode.HARDSIGMOID: (0.0, 0.0, 0.0),
    ActivationMode.MISH: (0.0, 0.0, 0.0),
}

# jax.nn.gelu(approximate=True)'s constants: tanh(GELU_SCALE * (x + GELU_CUBIC * x**3)).
GELU_SCALE = float(np.sqrt(2 / np.pi))
GELU_CUBIC = 0.044715
_SQRT_HALF = float(np.sqrt(0.5))


def activation_mode(mode: str | ActivationMode) -> ActivationMode:
    """Parses a mode name (case-insensitive; a few common aliases accepted)."""
    if isinstance(mode, ActivationMode):
        return mode
    if not isinstance(mode, str):
        raise TypeError(f"activation mode must be a string, got {mode!r}")
    key = mode.strip().lower().replace("-", "_")
    key = _ALIASES.get(key.replace("_", ""), _ALIASES.get(key, key))
    try:
        return ActivationMode(key)
    except ValueError:
        names = ", ".join(m.value for m in ActivationMode)
        raise ValueError(f"unknown activation mode {mode!r}; expected one of {names}") from None


def reference_activation(mode: str | ActivationMode, x: Any, alpha: Any = None, beta: Any = None,
                         gamma: Any = None, xp: Any = jnp) -> Any:
    """Applies `mode` to `x` with array module `xp` (jax.numpy, or NumPy for float64)."""
    mode = activation_mode(mode)
    da, db, dg = DEFAULT_PARAMS[mode]
    a = da if alpha is None else alpha
    b = db if beta is None else beta
    g = dg if gamma is None else gamma
    zero = xp.zeros((), x.dtype)
    if mode is ActivationMode.PASSTHRU:
        return x
    if mode is ActivationMode.LOGISTIC:
        return 1 / (1 + xp.exp(-x))
    if mode is ActivationMode.TANH:
        return b * xp.tanh(a * x)
    if mode is ActivationMode.RELU:
        return xp.maximum(x, zero)
    if mode is ActivationMode.SOFTRELU:
        return xp.logaddexp(x, zero)
    if mode is ActivationMode.ABS:
        return xp.abs(x)
    if mode is ActivationMode.POWER:
        base = a + b * x
        positive = base > 0
        return xp.where(positive, xp.where(positive, base, 1) ** g, zero)
    if mode is ActivationMode.CLIPPED_RELU:
        return xp.minimum(xp.maximum(x, zero), a)
    if mode is ActivationMode.LEAKY_RELU:
        return xp.where(x > 0, x, a * x)
    if mode is ActivationMode.ELU:
        return xp.where(x > 0, x, a * xp.expm1(xp.minimum(x, zero)))
    # The rest without overflow for any finite x (a NaN or an infinity gives what jax.nn's
    # formulas give: x * 0 = NaN at -inf for silu, gelu, hardswish and mish).
    if mode is ActivationMode.SILU:
        return x * _sigmoid(x, zero, xp)
    if mode is ActivationMode.GELU:
        return 0.5 * x * _erfc(-x * _SQRT_HALF, xp)
    if mode is ActivationMode.GELU_TANH:
        # 0.5 * (1 + tanh(u)) is sigmoid(2u), which does not cancel for negative u.
        return x * _sigmoid(2 * GELU_SCALE * (x + GELU_CUBIC * x**3), zero, xp)
    if mode is ActivationMode.HARDSWISH:
        return x * (xp.minimum(xp.maximum(x + 3, zero), 6) / 6)
    if mode is ActivationMode.HARDSIGMOID:
        return xp.minimum(xp.maximum(x + 3, zero), 6) / 6
    if mode is ActivationMode.MISH:
        return x * xp.tanh(xp.logaddexp(x, zero))
    raise AssertionError(mode)


def _sigmoid(x: Any, zero: Any, xp: Any) -> Any:
    """1 / (1 + exp(-x)) as exp(-log(1 + exp(-x))): no overflow for large -x."""
    return xp.exp(-xp.logaddexp(zero, -x))


def _erfc(x: Any, xp: Any) -> Any:
    if xp is np:
        import scipy.special  # jax depends on scipy; imported here, once a reference needs it

        return scipy.special.erfc(x)
    return jax.lax.erfc(x)


def jax_activation(mode: str | ActivationMode, x: Any, alpha: Any, beta: Any, gamma: Any) -> Any:
    """Applies `mode` to `x` in jax, differentiable with jax.nn's conventions at kinks.

    The values equal :func:`reference_activation`'s; the derivatives at kinks are jax.nn's:
    relu and clipped_relu have slope 0 at 0 and at the clip (like ``jax.nn.relu``/``relu6``),
    leaky_relu slope 1 and elu slope alpha at 0 (``jax.nn.leaky_relu``/``elu``), abs slope
    ``jnp.abs``'s, and power is flat (derivative 0) wherever ``alpha + beta * x <= 0``.
    The modes beyond MIOpen's are jax.nn's functions themselves (hardswish and hardsigmoid
    have slope 0 at -3 and at 3 inside the clip, like ``jax.nn.relu6``).
    """
    mode = activation_mode(mode)
    if mode in _JAX_NN:
        return _JAX_NN[mode](x)
    if mode is ActivationMode.LOGISTIC:
        return jax.nn.sigmoid(x)
    if mode is ActivationMode.RELU:
        return jax.nn.relu(x)
    if mode is ActivationMode.SOFTRELU:
        return jax.nn.softplus(x)
    if mode is ActivationMode.CLIPPED_RELU:
        return _clipped_relu(x, _float_parameter(alpha, x))
    if mode is ActivationMode.LEAKY_RELU:
        return _leaky_relu(x, _float_parameter(alpha, x))
    if mode is ActivationMode.ELU:
        return jax.nn.elu(x, alpha)
    # passthru, tanh, abs and power have no kinks jax.nn defines differently.
    return reference_activation(mode, x, alpha, beta, gamma, xp=jnp)


def _float_parameter(alpha: Any, x: Any) -> Any:
    """An integer parameter as floats (x's, as jnp.where's promotion made it): a custom JVP's
    integer inputs have no tangents to add."""
    if isinstance(alpha, int):
        return float(alpha)
    if jnp.issubdtype(jnp.result_type(alpha), jnp.integer):
        return jnp.asarray(alpha).astype(jnp.result_type(x))
    return alpha


@jax.custom_jvp
def _leaky_relu(x: Any, alpha: Any) -> Any:
    """``x if x > 0 else alpha * x``, the formula the fused kernels compute: at 0 a NaN or
    infinite alpha gives NaN there, where ``jax.nn.leaky_relu`` (``x >= 0``) gives 0, so the
    fused kernel and XLA's composition would disagree. The same operations otherwise."""
    return jnp.where(x > 0, x, alpha * x)


@_leaky_relu.defjvp
def _leaky_relu_jvp(primals: tuple[Any, Any], tangents: tuple[Any, Any]) -> tuple[Any, Any]:
    # jax.nn.leaky_relu's slopes: 1 at 0, and alpha's tangent only below 0.
    x, alpha = primals
    dx, dalpha = tangents
    at_least_zero = x >= 0
    tangent = jnp.where(at_least_zero, dx, alpha * dx) + jnp.where(at_least_zero, 0, x * dalpha)
    return _leaky_relu(x, alpha), tangent.astype(jnp.result_type(x))


@jax.custom_jvp
def _clipped_relu(x: Any, alpha: Any) -> Any:
    """``min(relu(x), alpha)``: NaN in x or alpha gives NaN. The two-sided clip that
    ``jax.nn.relu6`` is, which XLA fuses as it fuses relu6: an earlier form,
    ``where((r < alpha) | isnan(r), r, alpha)``, had XLA materialize the condition as a
    tensor of its own beside NCHW output transposes (H100, 2026-11-27: MobileNetV2's fp16
    NCHW 3x3 depthwise chain at batch 64 ran 216 us of kernels against relu6's 116 us)."""
    return jnp.minimum(jax.nn.relu(x), alpha)


@_clipped_relu.defjvp
def _clipped_relu_jvp(primals: tuple[Any, Any], tangents: tuple[Any, Any]) -> tuple[Any, Any]:
    # jax.nn.relu6's slopes: 0 at 0 and at the clip. Where the clip holds (alpha NaN
    # included) the value is alpha itself, so alpha's tangent passes there; NaN in x passes
    # neither tangent.
    x, alpha = primals
    dx, dalpha = tangents
    r = jax.nn.relu(x)
    out = jnp.minimum(r, alpha)
    below = r < alpha
    clipped = ~below & ~jnp.isnan(r)
    tangent = jnp.where(below & (x > 0), dx, 0) + jnp.where(clipped, dalpha, 0)
    return out, tangent.astype(out.dtype)


_JAX_NN = {
    ActivationMode.SILU: jax.nn.silu,
    ActivationMode.GELU: lambda x: jax.nn.gelu(x, approximate=False),
    ActivationMode.GELU_TANH: lambda x: jax.nn.gelu(x, approximate=True),
    ActivationMode.HARDSWISH: jax.nn.hard_swish,
    ActivationMode.HARDSIGMOID: jax.nn.hard_sigmoid,
    ActivationMode.MISH: jax.nn.mish,
}
