"""Activation modes of the fusion API and their reference formulas.

The formulas are MIOpen's (``y = f(x; alpha, beta, gamma)``); the numbering matches
``miopenActivationMode_t`` and the C++ epilogue (``csrc/kernels/epilogue.h``).
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp

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

    @property
    def code(self) -> int:
        """The integer the C++ epilogue switches on."""
        return _CODES[self]


_CODES = {mode: i for i, mode in enumerate(ActivationMode)}
_ALIASES = {"identity": "passthru", "sigmoid": "logistic", "softplus": "softrelu",
            "clippedrelu": "clipped_relu", "leakyrelu": "leaky_relu", "pasthru": "passthru"}

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
}


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
    raise AssertionError(mode)


def jax_activation(mode: str | ActivationMode, x: Any, alpha: Any, beta: Any, gamma: Any) -> Any:
    """Applies `mode` to `x` in jax, differentiable with jax.nn's conventions at kinks.

    The values equal :func:`reference_activation`'s; the derivatives at kinks are jax.nn's:
    relu and clipped_relu have slope 0 at 0 and at the clip (like ``jax.nn.relu``/``relu6``),
    leaky_relu slope 1 and elu slope alpha at 0 (``jax.nn.leaky_relu``/``elu``), abs slope
    ``jnp.abs``'s, and power is flat (derivative 0) wherever ``alpha + beta * x <= 0``.
    """
    mode = activation_mode(mode)
    if mode is ActivationMode.LOGISTIC:
        return jax.nn.sigmoid(x)
    if mode is ActivationMode.RELU:
        return jax.nn.relu(x)
    if mode is ActivationMode.SOFTRELU:
        return jax.nn.softplus(x)
    if mode is ActivationMode.CLIPPED_RELU:
        # Where the clip is active the value is alpha itself, so alpha gets the gradient there.
        # NaN in x passes through (as jnp.minimum's does); NaN in alpha fails `r < alpha`.
        r = jax.nn.relu(x)
        return jnp.where((r < alpha) | jnp.isnan(r), r, alpha)
    if mode is ActivationMode.LEAKY_RELU:
        return jax.nn.leaky_relu(x, alpha)
    if mode is ActivationMode.ELU:
        return jax.nn.elu(x, alpha)
    # passthru, tanh, abs and power have no kinks jax.nn defines differently.
    return reference_activation(mode, x, alpha, beta, gamma, xp=jnp)
