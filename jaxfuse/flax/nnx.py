"""Fused layers for Flax NNX: conv + batch norm + activation as one kernel at inference.

Each layer's state has exactly the paths of the unfused NNX layers it replaces, so
``nnx.state`` / ``nnx.update`` (and checkpoints made from them) move between the two:

- :class:`ConvBNAct`: attributes ``conv`` (an ``nnx.Conv``: ``conv/kernel``, ``conv/bias``)
  and ``bn`` (an ``nnx.BatchNorm``: ``bn/scale``, ``bn/bias``, ``bn/mean``, ``bn/var``).
- :class:`ConvAct`: an ``nnx.Conv`` (``kernel``, ``bias``) with an activation.
- :class:`BNAct`: an ``nnx.BatchNorm`` (``scale``, ``bias``, ``mean``, ``var``) with an
  activation.

Training (``use_running_average=False``, NNX's default for batch norm) runs the NNX layers
themselves, so statistics and gradients are exactly NNX's. Inference (``model.eval()``,
``nnx.view(model, use_running_average=True)`` or ``use_running_average=True``; always for
:class:`ConvAct`) runs one fused plan on the same state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ._activation import Activation, ActivationLike, resolve_activation
from ._fused import (
    BatchNormParams,
    ConvGeometry,
    batchnorm_activation,
    conv_activation,
    conv_geometry,
    feature_axis,
    promoted_dtype,
)

__all__ = ["Activation", "BNAct", "ConvAct", "ConvBNAct"]

# nnx.Conv's and nnx.BatchNorm's default initializers.
_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
_ZEROS = nnx.initializers.zeros_init()
_ONES = nnx.initializers.ones_init()


def _value(variable: Any) -> Any:
    return None if variable is None else variable[...]


def _fusable_conv(conv: nnx.Conv, owner: str) -> ConvGeometry:
    """The geometry of `conv`; ValueError if it uses something the fused op cannot do."""
    if not isinstance(conv, nnx.Conv):
        raise TypeError(f"{owner} needs an nnx.Conv, got {type(conv).__name__}")
    geometry = conv_geometry(kernel_size=conv.kernel_size, strides=conv.strides,
                             padding=conv.padding, input_dilation=conv.input_dilation,
                             kernel_dilation=conv.kernel_dilation,
                             feature_group_count=conv.feature_group_count, owner=owner)
    custom_conv = getattr(conv, "conv_general_dilated", lax.conv_general_dilated)
    if (conv.mask is not None or custom_conv is not lax.conv_general_dilated
            or getattr(conv, "preferred_element_type", None) is not None):
        raise ValueError(f"{owner}: mask, preferred_element_type and a custom "
                         "conv_general_dilated cannot be fused; use nnx.Conv")
    return geometry


def _running_average(flag: bool | None, default: bool | None, owner: str) -> bool:
    flag = default if flag is None else flag
    if flag is None:
        raise ValueError(f"{owner}: use_running_average is not set; pass it to the constructor "
                         "or the call, or use model.eval() / model.train()")
    return bool(flag)


def _conv_forward(conv: nnx.Conv, x: jax.Array, bn: nnx.BatchNorm | None,
                  activation: Activation | None, owner: str) -> jax.Array:
    """One fused plan from the state of `conv` (and `bn`, using its running statistics)."""
    geometry = _fusable_conv(conv, owner)
    kernel, bias = _value(conv.kernel), _value(conv.bias)
    compute = promoted_dtype(x, kernel, bias, dtype=conv.dtype)
    out, stats = compute, None
    if bn is not None:
        stats = BatchNormParams(_value(bn.scale), _value(bn.bias), _value(bn.mean),
                                _value(bn.var), bn.epsilon)
        # nnx.BatchNorm promotes its input with all four of its variables.
        out = promoted_dtype(compute, *stats[:4], dtype=bn.dtype)
    return conv_activation(x, kernel, bias, stats, geometry, compute_dtype=compute,
                           out_dtype=out, precision=conv.precision, activation=activation,
                           owner=owner)


class ConvBNAct(nnx.Module):
    """``activation(BatchNorm(Conv(x)))`` for NHWC inputs, fused into one kernel at inference.

    Arguments are those of ``nnx.Conv`` and ``nnx.BatchNorm`` (whose ``num_features`` is
    `out_features`); where both have an argument of the same name, the batch norm's is
    prefixed ``bn_`` (``bn_use_bias``, ``bn_bias_init``). `dtype` and `param_dtype` apply to
    both. :meth:`from_layers` wraps existing layers instead.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = ConvBNAct(4, 16, (3, 3), strides=2, activation=jax.nn.relu6, rngs=nnx.Rngs(0))
    >>> state = nnx.state(layer)                  # the paths of nnx.Conv + nnx.BatchNorm
    >>> sorted(state["conv"]), sorted(state["bn"])
    (['bias', 'kernel'], ['bias', 'mean', 'scale', 'var'])
    >>> layer.eval()
    >>> layer(jnp.ones((2, 8, 8, 4))).shape   # one fused kernel
    (2, 4, 4, 16)

    Args:
      in_features, out_features: input and output channels.
      kernel_size: ``(kh, kw)``; the layer is a 2-D convolution.
      strides, padding, kernel_dilation, feature_group_count, use_bias, precision,
        kernel_init, bias_init: as in ``nnx.Conv``.
      use_running_average, momentum, epsilon, use_scale, scale_init, axis_name,
        axis_index_groups, use_fast_variance: as in ``nnx.BatchNorm``.
      bn_use_bias, bn_bias_init: ``use_bias`` and ``bias_init`` of the batch norm.
      dtype: the computation dtype (default: promoted from the input and parameters).
      param_dtype: the parameters' dtype.
      activation: a mode name, a :class:`jaxfuse.flax.Activation`, a jax activation function
        with a fused equivalent (``jax.nn.relu``, ``relu6``, ``leaky_relu``, ``elu``,
        ``sigmoid``, ``softplus``, ``tanh``, ``silu``, ``gelu``, ``hard_swish``,
        ``hard_sigmoid``, ``mish``, ``jnp.abs``), or None for no activation.
      rngs: the random generators for initialization.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: Sequence[int],
                 strides: int | Sequence[int] | None = 1, *, padding: Any = "SAME",
                 kernel_dilation: int | Sequence[int] | None = 1, feature_group_count: int = 1,
                 use_bias: bool = True, precision: Any = None,
                 kernel_init: Any = _DEFAULT_KERNEL_INIT, bias_init: Any = _ZEROS,
                 use_running_average: bool | None = False, momentum: float = 0.99,
                 epsilon: float = 1e-5, use_scale: bool = True, bn_use_bias: bool = True,
                 scale_init: Any = _ONES, bn_bias_init: Any = _ZEROS,
                 axis_name: str | None = None,
                 axis_index_groups: Any = None, use_fast_variance: bool = True,
                 dtype: Any = None, param_dtype: Any = jnp.float32,
                 activation: ActivationLike = "relu", rngs: nnx.Rngs):
        self.conv = nnx.Conv(in_features, out_features, tuple(kernel_size), strides,
                             padding=padding, kernel_dilation=kernel_dilation,
                             feature_group_count=feature_group_count, use_bias=use_bias,
                             dtype=dtype, param_dtype=param_dtype, precision=precision,
                             kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
        self.bn = nnx.BatchNorm(out_features, use_running_average=use_running_average,
                                momentum=momentum, epsilon=epsilon, dtype=dtype,
                                param_dtype=param_dtype, use_bias=bn_use_bias,
                                use_scale=use_scale, bias_init=bn_bias_init,
                                scale_init=scale_init, axis_name=axis_name,
                                axis_index_groups=axis_index_groups,
                                use_fast_variance=use_fast_variance, rngs=rngs)
        self.activation = resolve_activation(activation, "ConvBNAct.activation")
        _fusable_conv(self.conv, "ConvBNAct")

    @classmethod
    def from_layers(cls, conv: nnx.Conv, bn: nnx.BatchNorm, *,
                    activation: ActivationLike = "relu") -> ConvBNAct:
        """A ConvBNAct made of existing layers: their configuration, and their state (shared,
        not copied: ``nnx.clone`` them first for an independent copy)."""
        if not isinstance(bn, nnx.BatchNorm):
            raise TypeError(f"ConvBNAct.from_layers needs an nnx.BatchNorm, got "
                            f"{type(bn).__name__}")
        _fusable_conv(conv, "ConvBNAct.from_layers")
        if bn.axis not in (-1, len(conv.kernel_size) + 1):
            raise ValueError(f"ConvBNAct.from_layers: the batch norm must normalize the "
                             f"conv's feature axis (-1), not axis {bn.axis}")
        # A one-channel placeholder, then the given layers take its place.
        layer = cls(1, 1, (1, 1), activation=activation, rngs=nnx.Rngs(0))
        layer.conv, layer.bn = conv, bn
        return layer

    def __call__(self, x: jax.Array, use_running_average: bool | None = None) -> jax.Array:
        """Applies the layer to `x` of shape ``(*batch, H, W, C)``.

        Args:
          x: the input, channels last.
          use_running_average: overrides ``self.bn.use_running_average`` for this call: True
            runs the fused kernel with the running statistics, False normalizes with the
            batch's statistics and updates them (NNX's BatchNorm).
        """
        if not _running_average(use_running_average, self.bn.use_running_average,
                                "ConvBNAct"):
            y = self.bn(self.conv(x), use_running_average=False)
            return y if self.activation is None else self.activation(y)
        return _conv_forward(self.conv, x, self.bn, self.activation, "ConvBNAct")


class ConvAct(nnx.Conv):
    """``activation(Conv(x))``: an ``nnx.Conv`` whose bias and activation run fused.

    Arguments and state are those of ``nnx.Conv`` (2-D, NHWC), plus keyword `activation` (see
    :class:`ConvBNAct`). ``input_dilation``, ``mask``, ``preferred_element_type`` and a custom
    ``conv_general_dilated`` cannot be fused and raise ValueError. Every call runs the fused
    kernel (differentiating it needs the fused op's rules, :mod:`jaxfuse.transforms`).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = ConvAct(3, 8, (3, 3), padding="VALID", activation="elu", rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 6, 6, 3))).shape
    (1, 4, 4, 8)
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: Sequence[int],
                 strides: int | Sequence[int] | None = 1, *,
                 activation: ActivationLike = "relu", **kwargs: Any):
        super().__init__(in_features, out_features, kernel_size, strides, **kwargs)
        self.activation = resolve_activation(activation, "ConvAct.activation")
        _fusable_conv(self, "ConvAct")

    def __call__(self, inputs: jax.Array) -> jax.Array:  # type: ignore[override]
        """Applies the fused convolution and activation to `inputs` (``(*batch, H, W, C)``)."""
        return _conv_forward(self, inputs, None, self.activation, "ConvAct")


class BNAct(nnx.BatchNorm):
    """``activation(BatchNorm(x))``: an ``nnx.BatchNorm`` fused with its activation at inference.

    Arguments and state are those of ``nnx.BatchNorm``, plus keyword `activation` (see
    :class:`ConvBNAct`). The feature axis must be a single axis (any rank).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = BNAct(3, activation=jax.nn.sigmoid, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 5, 5, 3)), use_running_average=True).shape
    (4, 5, 5, 3)
    """

    def __init__(self, num_features: int, *, activation: ActivationLike = "relu",
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.activation = resolve_activation(activation, "BNAct.activation")

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:  # type: ignore[override]
        """Normalizes `x` (batch statistics in training, running ones fused at inference)."""
        axis = feature_axis(x.ndim, self.axis, "BNAct")
        if not _running_average(use_running_average, self.use_running_average, "BNAct"):
            y = super().__call__(x, use_running_average=False, mask=mask)
            return y if self.activation is None else self.activation(y)
        stats = BatchNormParams(_value(self.scale), _value(self.bias), _value(self.mean),
                                _value(self.var), self.epsilon)
        out = promoted_dtype(x, *stats[:4], dtype=self.dtype)
        return batchnorm_activation(x, stats, axis, compute_dtype=jnp.promote_types(x.dtype, out),
                                    out_dtype=out, activation=self.activation, owner="BNAct")
