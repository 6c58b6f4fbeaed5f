"""Flax models with the convolution chains real networks have, for examples and benchmarks.

:class:`ResNet` (ResNet-50 by default: bottleneck blocks whose tails are
``relu(bn(conv(x)) + shortcut)``) and :class:`MobileNet` (MobileNetV2-style inverted residual
blocks: pointwise expand, depthwise 3x3, pointwise project, all with batch norm and relu6). Both
are ``flax.linen`` modules on NHWC inputs with the usual parameter names (``kernel``, ``scale``,
``bias``; batch statistics ``mean``/``var``). Flax is imported here, not by ``import jaxfuse``.

>>> import jax, jax.numpy as jnp
>>> model = ResNet(num_classes=10, width=8)
>>> x = jnp.ones((1, 32, 32, 3))
>>> variables = random_variables(model, x)
>>> model.apply(variables, x).shape
(1, 10)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MobileNet", "ResNet", "mobilenet", "random_variables", "resnet50"]


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand (x4); projection shortcut when shapes change."""

    features: int
    strides: int
    dtype: Any
    use_running_average: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=self.use_running_average,
                                 momentum=0.9, epsilon=1e-5, dtype=self.dtype)
        y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
        y = conv(self.features, (3, 3), self.strides, padding=((1, 1), (1, 1)))(y)
        y = nn.relu(norm()(y))
        y = norm()(conv(self.features * 4, (1, 1))(y))
        shortcut = x
        if x.shape[-1] != self.features * 4 or self.strides != 1:
            shortcut = norm()(conv(self.features * 4, (1, 1), self.strides)(x))
        return nn.relu(y + shortcut)


class ResNet(nn.Module):
    """A bottleneck ResNet on NHWC images; the defaults are ResNet-50.

    Attributes:
      stage_sizes: bottleneck blocks per stage ((3, 4, 6, 3) is ResNet-50).
      num_classes: logits of the final dense layer.
      width: channels of the first stage's 3x3 convolutions (64 in ResNet-50).
      dtype: computation dtype (parameters stay float32).
      use_running_average: True for inference (batch norm uses its running statistics).
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    num_classes: int = 1000
    width: int = 64
    dtype: Any = jnp.float32
    use_running_average: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.width, (7, 7), (2, 2), padding=((3, 3), (3, 3)), use_bias=False,
                    dtype=self.dtype, name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=self.use_running_average, momentum=0.9,
                         epsilon=1e-5, dtype=self.dtype, name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, blocks in enumerate(self.stage_sizes):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _Bottleneck(self.width * 2 ** stage, strides, self.dtype,
                                self.use_running_average)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


class _InvertedResidual(nn.Module):
    """Expand (1x1, relu6), depthwise 3x3 (relu6), project (1x1, linear), residual if able."""

    features: int
    strides: int
    expansion: int
    dtype: Any
    use_running_average: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=self.use_running_average,
                                 momentum=0.9, epsilon=1e-3, dtype=self.dtype)
        hidden = x.shape[-1] * self.expansion
        y = x
        if self.expansion != 1:
            y = nn.relu6(norm()(conv(hidden, (1, 1))(y)))
        y = conv(hidden, (3, 3), self.strides, padding=((1, 1), (1, 1)),
                 feature_group_count=hidden)(y)
        y = nn.relu6(norm()(y))
        y = norm()(conv(self.features, (1, 1))(y))
        if self.strides == 1 and x.shape[-1] == self.features:
            y = y + x
        return y


class MobileNet(nn.Module):
    """A MobileNetV2-style network of depthwise-separable inverted residual blocks.

    Attributes:
      blocks: (expansion, output channels, repeats, first stride) per stage.
      num_classes: logits of the final dense layer.
      width_multiplier: scales every stage's channels.
      dtype: computation dtype.
      use_running_average: True for inference.
    """

    blocks: Sequence[tuple[int, int, int, int]] = (
        (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
        (6, 160, 3, 2), (6, 320, 1, 1))
    num_classes: int = 1000
    width_multiplier: float = 1.0
    dtype: Any = jnp.float32
    use_running_average: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def channels(c: int) -> int:
            return max(8, int(c * self.width_multiplier + 4) // 8 * 8)

        norm = functools.partial(nn.BatchNorm, use_running_average=self.use_running_average,
                                 momentum=0.9, epsilon=1e-3, dtype=self.dtype)
        x = nn.Conv(channels(32), (3, 3), (2, 2), padding=((1, 1), (1, 1)), use_bias=False,
                    dtype=self.dtype, name="conv_init")(x)
        x = nn.relu6(norm(name="bn_init")(x))
        for expansion, features, repeats, stride in self.blocks:
            for i in range(repeats):
                x = _InvertedResidual(channels(features), stride if i == 0 else 1, expansion,
                                      self.dtype, self.use_running_average)(x)
        x = nn.Conv(channels(1280), (1, 1), use_bias=False, dtype=self.dtype,
                    name="conv_last")(x)
        x = nn.relu6(norm(name="bn_last")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


def resnet50(**kwargs: Any) -> ResNet:
    """ResNet-50 (override any :class:`ResNet` attribute)."""
    return ResNet(stage_sizes=(3, 4, 6, 3), **kwargs)


def mobilenet(**kwargs: Any) -> MobileNet:
    """MobileNetV2 at width 1.0 (override any :class:`MobileNet` attribute)."""
    return MobileNet(**kwargs)


def random_variables(model: nn.Module, x: jax.Array, seed: int = 0) -> Any:
    """Variables for `model` on input `x`, drawn with NumPy (no jax compilation: fast on CPU).

    Kernels are normal with variance 2 / fan-in; batch-norm scales, shifts and running
    statistics are random too (fresh flax batch norms are identities, which would hide mistakes
    in how they are fused; trained networks look more like this).
    """
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    rng = np.random.default_rng(seed)

    def draw(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        name = str(getattr(path[-1], "key", path[-1]))
        collection = str(getattr(path[0], "key", path[0]))
        shape, dtype = leaf.shape, leaf.dtype
        if collection == "batch_stats":
            value = (rng.uniform(0.5, 1.5, shape) if name == "var"
                     else 0.2 * rng.standard_normal(shape))
        elif name == "kernel":
            fan_in = int(np.prod(shape[:-1]))
            value = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
        elif name == "scale":
            value = rng.uniform(0.5, 1.5, shape)
        else:  # biases and batch-norm shifts
            value = 0.2 * rng.standard_normal(shape)
        return np.asarray(value, dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)
