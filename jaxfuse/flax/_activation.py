"""The `activation` argument of the Flax layers: a plan mode, or a jax.nn function it equals.

Fused (inference) code runs the mode inside the kernel; unfused (training) code calls the
function the user named, or the mode's jax.numpy formula, so both modes compute the same thing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..activations import ActivationMode, activation_mode, reference_activation

__all__ = ["Activation", "ActivationLike", "resolve_activation"]


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation the fused kernel can apply: a mode and its (alpha, beta, gamma).

    Pass one as a layer's `activation` to set parameters a plain mode name leaves at their
    defaults (see the README's activation table):

    >>> Activation("power", alpha=0.5, beta=0.7, gamma=1.7).mode
    <ActivationMode.POWER: 'power'>

    Attributes:
      mode: an activation mode (:class:`jaxfuse.ActivationMode` or its name).
      alpha, beta, gamma: the mode's parameters; None keeps the mode's default.
      fn: the jax function this activation stands for, called in unfused code (training)
        instead of the mode's formula; None uses the formula.
    """

    mode: ActivationMode
    alpha: float | None = None
    beta: float | None = None
    gamma: float | None = None
    fn: Callable[[jax.Array], jax.Array] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", activation_mode(self.mode))

    def __call__(self, y: jax.Array) -> jax.Array:
        """Applies the activation with XLA ops (the unfused, differentiable path)."""
        if self.fn is not None:
            return self.fn(y)
        return reference_activation(self.mode, y, self.alpha, self.beta, self.gamma)

    @property
    def fused_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the :mod:`jaxfuse.functional` calls."""
        return {"activation": self.mode, "activation_alpha": self.alpha,
                "activation_beta": self.beta, "activation_gamma": self.gamma}


ActivationLike = str | ActivationMode | Activation | Callable[[jax.Array], jax.Array] | None

# jax functions with a fused equivalent: (function, mode, keyword that sets alpha, its default).
# flax.linen.relu and flax.nnx.relu are these same objects.
_KNOWN_FUNCTIONS: tuple[tuple[Any, ActivationMode, str | None, float | None], ...] = (
    (jax.nn.relu, ActivationMode.RELU, None, None),
    (jax.nn.relu6, ActivationMode.CLIPPED_RELU, None, 6.0),
    (jax.nn.leaky_relu, ActivationMode.LEAKY_RELU, "negative_slope", 0.01),
    (jax.nn.elu, ActivationMode.ELU, "alpha", 1.0),
    (jax.nn.sigmoid, ActivationMode.LOGISTIC, None, None),
    (jax.nn.softplus, ActivationMode.SOFTRELU, None, None),
    (jnp.tanh, ActivationMode.TANH, None, None),
    (jax.nn.tanh, ActivationMode.TANH, None, None),
    (jnp.abs, ActivationMode.ABS, None, None),
    (jnp.absolute, ActivationMode.ABS, None, None),
    # jax.nn.swish and hard_silu are these same objects.
    (jax.nn.silu, ActivationMode.SILU, None, None),
    (jax.nn.hard_swish, ActivationMode.HARDSWISH, None, None),
    (jax.nn.hard_sigmoid, ActivationMode.HARDSIGMOID, None, None),
    (jax.nn.mish, ActivationMode.MISH, None, None),
)
# jax functions whose keyword picks the mode: (function, keyword, {value: mode}, its default).
_MODE_KEYWORDS: tuple[tuple[Any, str, dict[bool, ActivationMode], bool], ...] = (
    (jax.nn.gelu, "approximate",
     {True: ActivationMode.GELU_TANH, False: ActivationMode.GELU}, True),
)
_KNOWN_NAMES = ("jax.nn.relu, relu6, leaky_relu, elu, sigmoid, softplus, tanh, silu, gelu, "
                "hard_swish, hard_sigmoid, mish, jax.numpy.tanh, jax.numpy.abs")


def resolve_activation(activation: ActivationLike, owner: str = "activation"
                       ) -> Activation | None:
    """Turns a layer's `activation` argument into an :class:`Activation` (None: no activation).

    Accepts a mode name (``"relu"``, ``"clipped_relu"``, ...), an :class:`ActivationMode`, an
    :class:`Activation`, one of the jax functions with a fused equivalent (``jax.nn.relu6`` is
    ``clipped_relu`` with alpha 6, ``jax.nn.leaky_relu`` keeps jax's slope 0.01,
    ``jax.nn.gelu`` is ``gelu_tanh`` as its ``approximate=True`` default computes it), or a
    ``functools.partial`` of ``jax.nn.leaky_relu(negative_slope=...)``,
    ``jax.nn.elu(alpha=...)`` or ``jax.nn.gelu(approximate=...)`` (False: the ``gelu`` mode).
    """
    if activation is None or isinstance(activation, Activation):
        return activation
    if isinstance(activation, (str, ActivationMode)):
        return Activation(activation_mode(activation))
    if callable(activation):
        return _from_function(activation, owner)
    raise TypeError(f"{owner} must be a mode name, an Activation, a jax activation function or "
                    f"None; got {activation!r}")


def _from_function(fn: Callable[..., Any], owner: str) -> Activation:
    base, keywords = fn, {}
    if isinstance(fn, functools.partial):
        if fn.args:
            raise ValueError(f"{owner}: functools.partial({fn.func!r}, ...) with positional "
                             "arguments cannot be fused; bind parameters by keyword")
        base, keywords = fn.func, dict(fn.keywords)
    for known, keyword, modes, default in _MODE_KEYWORDS:
        if base is not known:
            continue
        unknown = set(keywords) - {keyword}
        if unknown:
            raise ValueError(f"{owner}: keyword(s) {sorted(unknown)} of {known.__name__} have no "
                             f"fused equivalent (only {keyword} picks a mode)")
        value = keywords.get(keyword, default)
        if not isinstance(value, bool | np.bool_):
            raise ValueError(f"{owner}: {known.__name__}({keyword}={value!r}) cannot be fused; "
                             f"{keyword} must be True or False")
        return Activation(modes[bool(value)], fn=fn)
    for known, mode, keyword, default in _KNOWN_FUNCTIONS:
        if base is not known:
            continue
        unknown = set(keywords) - {keyword}
        if unknown:
            raise ValueError(f"{owner}: keyword(s) {sorted(unknown)} of {known.__name__} have no "
                             f"fused equivalent (the {mode.value} mode takes "
                             f"{keyword or 'no parameters'})")
        alpha = float(keywords.get(keyword, default)) if default is not None else None
        return Activation(mode, alpha=alpha, fn=fn)
    raise ValueError(f"{owner}: {fn!r} has no fused equivalent; use an activation mode name "
                     f"(jaxfuse.ActivationMode) or one of {_KNOWN_NAMES}")
