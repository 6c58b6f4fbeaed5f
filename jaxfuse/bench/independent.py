"""ResNet-50 and MobileNetV2 in Flax linen, written independently of :mod:`jaxfuse.bench.models`
(without reading it), the way a new user would write them from the torchvision and Flax
examples, to check :func:`jaxfuse.fuse` on code that it was not shaped around.
EfficientNet-B0 (MBConv blocks with depthwise convolutions, squeeze-and-excitation and swish)
was added the same way, from the paper, not modelled on this module's other networks.

All take NHWC images and a computation ``dtype``; parameters stay float32 (Flax's default
``param_dtype``). Batch norm runs in inference mode (running averages).

    model = ResNet50(dtype=jnp.bfloat16)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3), jnp.bfloat16))
    logits = model.apply(variables, images)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["EfficientNetB0", "MobileNetV2", "ResNet50"]


# ----- ResNet-50 (torchvision's resnet50: v1.5, the stride on the 3x3 convolution) -------------
class Bottleneck(nn.Module):
    features: int
    strides: int = 1
    expansion: int = 4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = partial(nn.BatchNorm, use_running_average=True, momentum=0.9, epsilon=1e-5,
                       dtype=self.dtype)

        shortcut = x
        y = conv(self.features, (1, 1))(x)
        y = norm()(y)
        y = nn.relu(y)
        y = conv(self.features, (3, 3), strides=(self.strides, self.strides), padding=1)(y)
        y = norm()(y)
        y = nn.relu(y)
        y = conv(self.features * self.expansion, (1, 1))(y)
        y = norm()(y)

        if self.strides != 1 or x.shape[-1] != self.features * self.expansion:
            shortcut = conv(self.features * self.expansion, (1, 1),
                            strides=(self.strides, self.strides), name="downsample_conv")(x)
            shortcut = norm(name="downsample_bn")(shortcut)

        return nn.relu(y + shortcut)


class ResNet50(nn.Module):
    num_classes: int = 1000
    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), strides=(2, 2), padding=3, use_bias=False, dtype=self.dtype,
                    name="conv1")(x)
        x = nn.BatchNorm(use_running_average=True, momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                         name="bn1")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))

        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = 2 if i > 0 and j == 0 else 1
                x = Bottleneck(64 * 2**i, strides=strides, dtype=self.dtype,
                               name=f"layer{i + 1}_{j}")(x)

        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="fc")(x)
        return x


# ----- MobileNetV2 (Sandler et al. 2018; torchvision's mobilenet_v2, width 1.0) -----------------
def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class InvertedResidual(nn.Module):
    out_features: int
    strides: int
    expand_ratio: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        in_features = x.shape[-1]
        hidden = in_features * self.expand_ratio
        norm = partial(nn.BatchNorm, use_running_average=True, momentum=0.9, epsilon=1e-5,
                       dtype=self.dtype)

        y = x
        if self.expand_ratio != 1:
            y = nn.Conv(hidden, (1, 1), use_bias=False, dtype=self.dtype, name="expand")(y)
            y = norm(name="expand_bn")(y)
            y = jax.nn.relu6(y)
        # depthwise
        y = nn.Conv(hidden, (3, 3), strides=(self.strides, self.strides), padding="SAME",
                    feature_group_count=hidden, use_bias=False, dtype=self.dtype,
                    name="depthwise")(y)
        y = norm(name="depthwise_bn")(y)
        y = jax.nn.relu6(y)
        # linear bottleneck: no activation after the projection
        y = nn.Conv(self.out_features, (1, 1), use_bias=False, dtype=self.dtype,
                    name="project")(y)
        y = norm(name="project_bn")(y)

        if self.strides == 1 and in_features == self.out_features:
            return x + y
        return y


class MobileNetV2(nn.Module):
    num_classes: int = 1000
    width_mult: float = 1.0
    dtype: Any = jnp.float32
    # (t, c, n, s): expansion, output channels, repeats, stride of the first repeat
    inverted_residual_setting: Sequence[tuple[int, int, int, int]] = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    @nn.compact
    def __call__(self, x):
        input_channel = _make_divisible(32 * self.width_mult)
        last_channel = _make_divisible(1280 * max(1.0, self.width_mult))

        x = nn.Conv(input_channel, (3, 3), strides=(2, 2), padding="SAME", use_bias=False,
                    dtype=self.dtype, name="stem")(x)
        x = nn.BatchNorm(use_running_average=True, momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                         name="stem_bn")(x)
        x = jnp.clip(x, 0, 6)

        for t, c, n, s in self.inverted_residual_setting:
            out = _make_divisible(c * self.width_mult)
            for i in range(n):
                x = InvertedResidual(out, s if i == 0 else 1, t, dtype=self.dtype)(x)

        x = nn.Conv(last_channel, (1, 1), use_bias=False, dtype=self.dtype, name="head")(x)
        x = nn.BatchNorm(use_running_average=True, momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                         name="head_bn")(x)
        x = jax.nn.relu6(x)

        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(0.2, deterministic=True)(x)
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="classifier")(x)
        return x


# ----- EfficientNet-B0 (Tan & Le 2019, table 1; TF reference's batch norm, SE on block inputs) ---
class SqueezeExcite(nn.Module):
    squeeze_features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        s = nn.Conv(self.squeeze_features, (1, 1), dtype=self.dtype, name="reduce")(s)
        s = jax.nn.silu(s)
        s = nn.Conv(x.shape[-1], (1, 1), dtype=self.dtype, name="expand")(s)
        return x * nn.sigmoid(s)


class MBConv(nn.Module):
    out_features: int
    kernel_size: int
    strides: int
    expand_ratio: int
    se_ratio: float = 0.25
    drop_path_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        in_features = x.shape[-1]
        hidden = in_features * self.expand_ratio
        norm = partial(nn.BatchNorm, use_running_average=True, momentum=0.99, epsilon=1e-3,
                       dtype=self.dtype)

        y = x
        if self.expand_ratio != 1:
            y = nn.Conv(hidden, (1, 1), use_bias=False, dtype=self.dtype, name="expand")(y)
            y = nn.swish(norm(name="expand_bn")(y))
        k = self.kernel_size
        y = nn.Conv(hidden, (k, k), strides=self.strides, padding=(k - 1) // 2,
                    feature_group_count=hidden, use_bias=False, dtype=self.dtype,
                    name="depthwise")(y)
        y = nn.swish(norm(name="depthwise_bn")(y))
        y = SqueezeExcite(max(1, int(in_features * self.se_ratio)), dtype=self.dtype,
                          name="se")(y)
        y = nn.Conv(self.out_features, (1, 1), use_bias=False, dtype=self.dtype,
                    name="project")(y)
        y = norm(name="project_bn")(y)
        if self.strides == 1 and in_features == self.out_features:
            # Stochastic depth: drops whole samples' residual branches in training only.
            y = nn.Dropout(self.drop_path_rate, broadcast_dims=(1, 2, 3), deterministic=True)(y)
            y = y + x
        return y


class EfficientNetB0(nn.Module):
    num_classes: int = 1000
    dropout_rate: float = 0.2
    drop_path_rate: float = 0.2
    dtype: Any = jnp.float32
    # (expand_ratio, kernel, stride, out_features, repeats) per stage
    block_setting: Sequence[tuple[int, int, int, int, int]] = (
        (1, 3, 1, 16, 1),
        (6, 3, 2, 24, 2),
        (6, 5, 2, 40, 2),
        (6, 3, 2, 80, 3),
        (6, 5, 1, 112, 3),
        (6, 5, 2, 192, 4),
        (6, 3, 1, 320, 1),
    )

    @nn.compact
    def __call__(self, x):
        norm = partial(nn.BatchNorm, use_running_average=True, momentum=0.99, epsilon=1e-3,
                       dtype=self.dtype)
        x = nn.Conv(32, (3, 3), strides=2, padding=1, use_bias=False, dtype=self.dtype,
                    name="stem")(x)
        x = nn.swish(norm(name="stem_bn")(x))
        total = sum(n for *_, n in self.block_setting)
        index = 0
        for t, k, s, c, n in self.block_setting:
            for i in range(n):
                x = MBConv(c, k, s if i == 0 else 1, t,
                           drop_path_rate=self.drop_path_rate * index / total,
                           dtype=self.dtype)(x)
                index += 1
        x = nn.Conv(1280, (1, 1), use_bias=False, dtype=self.dtype, name="head")(x)
        x = nn.swish(norm(name="head_bn")(x))
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=True)(x)
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="classifier")(x)
        return x
