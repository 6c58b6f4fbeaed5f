"""Fused layers for Flax linen: conv + batch norm + activation as one kernel at inference.

Each layer stores exactly the variables of the unfused flax layers it replaces, so checkpoints
move between the two without conversion:

- :class:`ConvBNAct`: ``nn.Conv(name="conv")`` then ``nn.BatchNorm(name="bn")`` then the
  activation; ``params/conv/{kernel,bias}``, ``params/bn/{scale,bias}``,
  ``batch_stats/bn/{mean,var}``.
- :class:`ConvAct`: an ``nn.Conv`` (``params/{kernel,bias}``) then the activation.
- :class:`BNAct`: an ``nn.BatchNorm`` (``params/{scale,bias}``, ``batch_stats/{mean,var}``)
  then the activation.

Initialization and training (``use_running_average=False``) run flax's own layers, so they
create, update and differentiate the variables exactly as flax does. Inference
(``use_running_average=True``; always for :class:`ConvAct`) reads the variables and runs one
fused plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from ._activation import Activation, ActivationLike, resolve_activation
from ._fused import (
    BatchNormParams,
    batchnorm_activation,
    conv_activation,
    conv_geometry,
    feature_axis,
    promoted_dtype,
)
from .variables import conv_bn_variables, fuse_conv_bn_variables, split_conv_bn_variables

__all__ = ["Activation", "BNAct", "ConvAct", "ConvBNAct", "conv_bn_variables",
           "fuse_conv_bn_variables", "split_conv_bn_variables"]

Initializer = Any
Dtype = Any


def _variable(module: nn.Module, collection: str, *path: str) -> Any:
    """The variable at `path`, or a ValueError saying which one is missing."""
    node: Any = module.variables.get(collection, {})
    for key in path:
        if not hasattr(node, "get") or key not in node:
            name = type(module).__name__ + (f" {module.name!r}" if module.name else "")
            raise ValueError(f"{name} has no variable {'/'.join((collection, *path))}; "
                             "initialize it with .init() or pass variables in this layout "
                             "(see jaxfuse.flax.linen)")
        node = node[key]
    return node


class ConvBNAct(nn.Module):
    """``activation(BatchNorm(Conv(x)))`` for NHWC inputs, fused into one kernel at inference.

    Arguments are those of ``nn.Conv`` and ``nn.BatchNorm``; where both have an argument of the
    same name, the batch norm's is prefixed ``bn_`` (``bn_use_bias``, ``bn_bias_init``).
    `dtype` and `param_dtype` apply to both. The variables are those of
    ``nn.Conv(name="conv")`` and ``nn.BatchNorm(name="bn")``.

    >>> import jax, jax.numpy as jnp
    >>> layer = ConvBNAct(16, (3, 3), strides=2, activation=jax.nn.relu6)
    >>> x = jnp.ones((2, 8, 8, 4))
    >>> variables = layer.init(jax.random.key(0), x, use_running_average=True)
    >>> jax.tree.map(jnp.shape, variables["batch_stats"])
    {'bn': {'mean': (16,), 'var': (16,)}}
    >>> layer.apply(variables, x, use_running_average=True).shape   # one fused kernel
    (2, 4, 4, 16)

    Attributes:
      features: number of output channels.
      kernel_size: ``(kh, kw)``; the layer is a 2-D convolution.
      strides, padding, kernel_dilation, feature_group_count, use_bias, precision,
        kernel_init, bias_init: as in ``nn.Conv`` (padding ``"SAME"``, ``"VALID"``,
        ``"CIRCULAR"``, ``"REFLECT"``, an int, or two ints or ``(low, high)`` pairs).
      use_running_average, momentum, epsilon, use_scale, scale_init, axis_name,
        axis_index_groups, use_fast_variance: as in ``nn.BatchNorm``.
      bn_use_bias, bn_bias_init: ``use_bias`` and ``bias_init`` of the batch norm.
      dtype: the computation dtype (default: promoted from the input and parameters).
      param_dtype: the parameters' dtype.
      activation: a mode name, a :class:`jaxfuse.flax.Activation`, a jax activation function
        with a fused equivalent (``jax.nn.relu``, ``relu6``, ``leaky_relu``, ``elu``,
        ``sigmoid``, ``softplus``, ``tanh``, ``silu``, ``gelu``, ``hard_swish``,
        ``hard_sigmoid``, ``mish``, ``jnp.abs``), or None for no activation.
    """

    features: int
    kernel_size: Sequence[int]
    strides: int | Sequence[int] | None = 1
    padding: Any = "SAME"
    kernel_dilation: int | Sequence[int] | None = 1
    feature_group_count: int = 1
    use_bias: bool = True
    precision: Any = None
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()
    use_running_average: bool | None = None
    momentum: float = 0.99
    epsilon: float = 1e-5
    use_scale: bool = True
    bn_use_bias: bool = True
    scale_init: Initializer = nn.initializers.ones_init()
    bn_bias_init: Initializer = nn.initializers.zeros_init()
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    activation: ActivationLike = "relu"

    @nn.compact
    def __call__(self, x: jax.Array, use_running_average: bool | None = None) -> jax.Array:
        """Applies the layer to `x` of shape ``(*batch, H, W, C)``.

        Args:
          x: the input, channels last.
          use_running_average: True normalizes with the stored statistics (inference, fused);
            False with the batch's statistics, updating ``batch_stats`` (training, which must
            be mutable). Set it here or as the attribute, not both (flax's rule).
        """
        use_running_average = nn.merge_param("use_running_average", self.use_running_average,
                                             use_running_average)
        owner = "ConvBNAct"
        activation = resolve_activation(self.activation, f"{owner}.activation")
        geometry = conv_geometry(kernel_size=self.kernel_size, strides=self.strides,
                                 padding=self.padding, input_dilation=1,
                                 kernel_dilation=self.kernel_dilation,
                                 feature_group_count=self.feature_group_count, owner=owner)
        conv = nn.Conv(self.features, tuple(self.kernel_size), strides=self.strides,
                       padding=self.padding, kernel_dilation=self.kernel_dilation,
                       feature_group_count=self.feature_group_count, use_bias=self.use_bias,
                       dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                       kernel_init=self.kernel_init, bias_init=self.bias_init, name="conv")
        bn = nn.BatchNorm(momentum=self.momentum, epsilon=self.epsilon, dtype=self.dtype,
                          param_dtype=self.param_dtype, use_bias=self.bn_use_bias,
                          use_scale=self.use_scale, bias_init=self.bn_bias_init,
                          scale_init=self.scale_init, axis_name=self.axis_name,
                          axis_index_groups=self.axis_index_groups,
                          use_fast_variance=self.use_fast_variance, name="bn")
        if self.is_initializing() or not use_running_average:
            y = bn(conv(x), use_running_average=use_running_average)
            return y if activation is None else activation(y)

        kernel = _variable(self, "params", "conv", "kernel")
        conv_bias = _variable(self, "params", "conv", "bias") if self.use_bias else None
        scale = _variable(self, "params", "bn", "scale") if self.use_scale else None
        bn_bias = _variable(self, "params", "bn", "bias") if self.bn_use_bias else None
        stats = BatchNormParams(scale, bn_bias, _variable(self, "batch_stats", "bn", "mean"),
                                _variable(self, "batch_stats", "bn", "var"), self.epsilon)
        # nn.Conv computes in the promoted dtype; nn.BatchNorm returns the same dtype.
        compute = promoted_dtype(x, kernel, conv_bias, dtype=self.dtype)
        return conv_activation(x, kernel, conv_bias, stats, geometry, compute_dtype=compute,
                               out_dtype=compute, precision=self.precision,
                               activation=activation, owner=owner)


class ConvAct(nn.Conv):
    """``activation(Conv(x))``: an ``nn.Conv`` whose bias and activation run fused.

    The arguments and variables are those of ``nn.Conv`` (2-D, NHWC), plus `activation` (see
    :class:`ConvBNAct`). ``input_dilation``, ``mask`` and a custom ``conv_general_dilated``
    cannot be fused and raise ValueError. There is no training mode: every call after
    ``init`` runs the fused kernel (differentiating it needs the fused op's differentiation
    rules, :mod:`jaxfuse.transforms`).

    >>> import jax, jax.numpy as jnp
    >>> layer = ConvAct(8, (3, 3), padding="VALID", activation="leaky_relu")
    >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 6, 6, 3)))
    >>> layer.apply(variables, jnp.ones((1, 6, 6, 3))).shape
    (1, 4, 4, 8)
    """

    activation: ActivationLike = "relu"

    def __call__(self, inputs: jax.Array) -> jax.Array:  # type: ignore[override]
        """Applies the convolution and activation to `inputs` of shape ``(*batch, H, W, C)``."""
        owner = "ConvAct"
        activation = resolve_activation(self.activation, f"{owner}.activation")
        geometry = conv_geometry(kernel_size=self.kernel_size, strides=self.strides,
                                 padding=self.padding, input_dilation=self.input_dilation,
                                 kernel_dilation=self.kernel_dilation,
                                 feature_group_count=self.feature_group_count, owner=owner)
        if self.mask is not None or self.conv_general_dilated is not None or getattr(
                self, "conv_general_dilated_cls", None) is not None:
            raise ValueError(f"{owner}: mask and a custom conv_general_dilated cannot be fused; "
                             "use nn.Conv")
        if self.is_initializing():
            y = super().__call__(inputs)
            return y if activation is None else activation(y)
        kernel = _variable(self, "params", "kernel")
        bias = _variable(self, "params", "bias") if self.use_bias else None
        compute = promoted_dtype(inputs, kernel, bias, dtype=self.dtype)
        return conv_activation(inputs, kernel, bias, None, geometry, compute_dtype=compute,
                               out_dtype=compute, precision=self.precision,
                               activation=activation, owner=owner)


class BNAct(nn.BatchNorm):
    """``activation(BatchNorm(x))``: an ``nn.BatchNorm`` fused with its activation at inference.

    The arguments and variables are those of ``nn.BatchNorm``, plus `activation` (see
    :class:`ConvBNAct`). The feature axis must be a single axis (any rank).

    >>> import jax, jax.numpy as jnp
    >>> layer = BNAct(activation=jax.nn.elu)
    >>> x = jnp.ones((4, 5, 5, 3))
    >>> variables = layer.init(jax.random.key(0), x, use_running_average=True)
    >>> layer.apply(variables, x, use_running_average=True).shape
    (4, 5, 5, 3)
    """

    activation: ActivationLike = "relu"

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:  # type: ignore[override]
        """Normalizes `x` (batch statistics in training, running ones fused at inference)."""
        use_running_average = nn.merge_param("use_running_average", self.use_running_average,
                                             use_running_average)
        owner = "BNAct"
        activation = resolve_activation(self.activation, f"{owner}.activation")
        axis = feature_axis(x.ndim, self.axis, owner)
        if self.is_initializing() or not use_running_average:
            y = super().__call__(x, use_running_average, mask=mask)
            return y if activation is None else activation(y)
        scale = _variable(self, "params", "scale") if self.use_scale else None
        bias = _variable(self, "params", "bias") if self.use_bias else None
        stats = BatchNormParams(scale, bias, _variable(self, "batch_stats", "mean"),
                                _variable(self, "batch_stats", "var"), self.epsilon)
        out = promoted_dtype(x, scale, bias, dtype=self.dtype)
        return batchnorm_activation(x, stats, axis, compute_dtype=jnp.promote_types(x.dtype, out),
                                    out_dtype=out, activation=activation, owner=owner)
