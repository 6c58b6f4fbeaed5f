"""The benchmark suites: layer shapes and the fused chain each one runs."""

from __future__ import annotations

import dataclasses

__all__ = ["SUITES", "Layer"]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One convolution layer (or, with ``r == 0``, a conv-less batch-norm + activation)."""

    name: str
    c: int
    k: int
    hw: int
    r: int = 1
    stride: int = 1
    pad: int = 0
    groups: int = 1
    activation: str | None = "relu"  # None: the chain ends before the activation
    count: int = 1  # how often the network runs this shape (network-weighted totals)
    residual: bool = False  # a residual add before the activation (a ResNet block's tail)

    @property
    def has_conv(self) -> bool:
        return self.r > 0

    def out_hw(self) -> int:
        if not self.has_conv:
            return self.hw
        return (self.hw + 2 * self.pad - self.r) // self.stride + 1

    def flops(self, n: int) -> int:
        if not self.has_conv:
            return 0
        return 2 * n * self.k * self.out_hw() ** 2 * (self.c // self.groups) * self.r * self.r

    def min_bytes(self, n: int, itemsize: int) -> int:
        """Each input read once, the output written once (parameters are negligible)."""
        x = n * self.c * self.hw * self.hw
        y = n * self.k * self.out_hw() ** 2 * (2 if self.residual else 1)  # and the residual
        w = self.k * (self.c // self.groups) * self.r * self.r if self.has_conv else 0
        return (x + y + w) * itemsize


# ResNet-50's distinct convolution shapes (the ones ../shared/perf measured).
RESNET50 = [
    Layer("r50_conv1_7x7s2", 3, 64, 224, 7, 2, 3),
    Layer("r50_l1_1x1_64", 64, 64, 56),
    Layer("r50_l1_3x3_64", 64, 64, 56, 3, 1, 1),
    Layer("r50_l1_1x1_256", 64, 256, 56),
    Layer("r50_l2_3x3_128", 128, 128, 28, 3, 1, 1),
    Layer("r50_l3_3x3_256", 256, 256, 14, 3, 1, 1),
    Layer("r50_l4_3x3_512", 512, 512, 7, 3, 1, 1),
    Layer("r50_l4_1x1_2048", 512, 2048, 7),
]

# Every distinct convolution of ResNet-50 (torchvision's / the bench model's: stride in the 3x3),
# with how often the network runs it: the sum over this suite is the network's convolutions.
RESNET50_NET = [
    Layer("r50n_stem_7x7s2", 3, 64, 224, 7, 2, 3),
    Layer("r50n_56_64_64", 64, 64, 56),
    Layer("r50n_56_3x3_64", 64, 64, 56, 3, 1, 1, count=3),
    Layer("r50n_56_64_256", 64, 256, 56, count=4),
    Layer("r50n_56_256_64", 256, 64, 56, count=2),
    Layer("r50n_56_256_128", 256, 128, 56),
    Layer("r50n_56_3x3_128s2", 128, 128, 56, 3, 2, 1),
    Layer("r50n_56_256_512s2", 256, 512, 56, 1, 2, activation=None),
    Layer("r50n_28_128_512", 128, 512, 28, count=4),
    Layer("r50n_28_512_128", 512, 128, 28, count=3),
    Layer("r50n_28_3x3_128", 128, 128, 28, 3, 1, 1, count=3),
    Layer("r50n_28_512_256", 512, 256, 28),
    Layer("r50n_28_3x3_256s2", 256, 256, 28, 3, 2, 1),
    Layer("r50n_28_512_1024s2", 512, 1024, 28, 1, 2, activation=None),
    Layer("r50n_14_256_1024", 256, 1024, 14, count=6),
    Layer("r50n_14_1024_256", 1024, 256, 14, count=5),
    Layer("r50n_14_3x3_256", 256, 256, 14, 3, 1, 1, count=5),
    Layer("r50n_14_1024_512", 1024, 512, 14),
    Layer("r50n_14_3x3_512s2", 512, 512, 14, 3, 2, 1),
    Layer("r50n_14_1024_2048s2", 1024, 2048, 14, 1, 2, activation=None),
    Layer("r50n_7_512_2048", 512, 2048, 7, count=3),
    Layer("r50n_7_2048_512", 2048, 512, 7, count=2),
    Layer("r50n_7_3x3_512", 512, 512, 7, 3, 1, 1, count=2),
]

# ResNet-50's block tails: the last 1x1 convolution of every bottleneck, its batch norm, the
# residual add and the relu (conv -> bn -> add -> relu, 16 of the network's 53 chains).
RESNET50_TAILS = [
    Layer("r50t_56_64_256", 64, 256, 56, count=3, residual=True),
    Layer("r50t_28_128_512", 128, 512, 28, count=4, residual=True),
    Layer("r50t_14_256_1024", 256, 1024, 14, count=6, residual=True),
    Layer("r50t_7_512_2048", 512, 2048, 7, count=3, residual=True),
]

# MobileNet (v1/v2-style) depthwise 3x3 layers.
MOBILENET = [
    Layer("mb_dw_112_32", 32, 32, 112, 3, 1, 1, 32),
    Layer("mb_dw_56_128s2", 128, 128, 112, 3, 2, 1, 128),
    Layer("mb_dw_28_256", 256, 256, 28, 3, 1, 1, 256),
    Layer("mb_dw_14_512", 512, 512, 14, 3, 1, 1, 512),
    Layer("mb_dw_7_1024", 1024, 1024, 7, 3, 1, 1, 1024),
]

# MobileNetV2 (224x224): the stem, the depthwise 3x3 layers and the 1x1 expansions (relu6) and
# projections (no activation) at each resolution, with its channel counts (16, 24, 32, 64, 96,
# 144, 160, 192, 320, 384, 576, 960, 1280).
_RELU6 = "clipped_relu"
MOBILENETV2 = [
    Layer("mb2_stem_3x3s2_32", 3, 32, 224, 3, 2, 1, activation=_RELU6),
    Layer("mb2_dw_112_32", 32, 32, 112, 3, 1, 1, 32, _RELU6),
    Layer("mb2_pw_112_32_16", 32, 16, 112, activation=None),
    Layer("mb2_pw_112_16_96", 16, 96, 112, activation=_RELU6),
    Layer("mb2_dw_112_96s2", 96, 96, 112, 3, 2, 1, 96, _RELU6),
    Layer("mb2_pw_56_96_24", 96, 24, 56, activation=None),
    Layer("mb2_pw_56_24_144", 24, 144, 56, activation=_RELU6),
    Layer("mb2_dw_56_144", 144, 144, 56, 3, 1, 1, 144, _RELU6),
    Layer("mb2_pw_28_144_32", 144, 32, 28, activation=None),
    Layer("mb2_pw_28_32_192", 32, 192, 28, activation=_RELU6),
    Layer("mb2_dw_28_192", 192, 192, 28, 3, 1, 1, 192, _RELU6),
    Layer("mb2_pw_14_384_64", 384, 64, 14, activation=None),
    Layer("mb2_dw_14_384", 384, 384, 14, 3, 1, 1, 384, _RELU6),
    Layer("mb2_pw_14_96_576", 96, 576, 14, activation=_RELU6),
    Layer("mb2_pw_7_160_960", 160, 960, 7, activation=_RELU6),
    Layer("mb2_dw_7_960", 960, 960, 7, 3, 1, 1, 960, _RELU6),
    Layer("mb2_pw_7_320_1280", 320, 1280, 7, activation=_RELU6),
]

# Batch norm + activation without a convolution (MIOpen's NA fusion).
NA = [
    Layer("NA_C64_H112", 64, 64, 112, 0),
    Layer("NA_C256_H56", 256, 256, 56, 0),
    Layer("NA_C1024_H14", 1024, 1024, 14, 0),
]

SUITES = {"resnet50": RESNET50, "resnet50_net": RESNET50_NET, "resnet50_tails": RESNET50_TAILS,
          "mobilenet": MOBILENET,
          "mobilenetv2": MOBILENETV2, "na": NA}
