"""Which plans jaxfuse can fuse, and why not when it cannot.

Every rejection raises :class:`UnsupportedFusionError` (or ``ValueError``/``TypeError`` for
descriptors that contradict each other) with a sentence naming the operator and the reason.
"""

from __future__ import annotations

import itertools

import numpy as np

from .descriptors import FILTER_LAYOUTS, ConvDesc, TensorDesc, filter_layout
from .errors import FusionError, UnsupportedFusionError
from .ops import FusionOp
from .signature import ConvSpec

__all__ = ["check_append", "check_conv", "check_input", "supported_chains"]

POINTWISE = "BNSA"
_NAMES = {"C": "convolution", "B": "bias", "N": "batchnorm", "S": "side-input add",
          "A": "activation"}


def check_input(desc: TensorDesc) -> None:
    """A plan's input must be a 4-D NCHW or NHWC tensor with channels and pixels."""
    if not isinstance(desc, TensorDesc):
        raise TypeError(f"FusionPlan needs a TensorDesc for its input, got {type(desc).__name__}")
    if desc.ndim != 4 or desc.layout not in ("NCHW", "NHWC"):
        raise UnsupportedFusionError(
            f"plan input must be a 4-D NCHW or NHWC tensor, got shape {desc.shape} "
            f"layout {desc.layout!r}")
    if min(desc.dim("C"), desc.dim("H"), desc.dim("W")) < 1:
        raise FusionError(f"plan input {desc.shape} has an empty channel or spatial dimension")


def check_append(ops: list[FusionOp], letter: str) -> None:
    """Raises unless an operator of kind `letter` may follow `ops`."""
    name = _NAMES[letter]
    if letter == "C" and ops:
        raise UnsupportedFusionError(
            f"cannot add a convolution after the {_NAMES[ops[-1].letter]} operator: a fusion "
            "plan is a vertical chain and its convolution must be the first operator")
    for op in ops:
        if op.letter == letter:
            raise UnsupportedFusionError(
                f"the plan already has {'an' if name[0] in 'aeiou' else 'a'} {name} operator "
                f"(operator {op.index}); a plan holds at most one of each kind")


def check_conv(input_desc: TensorDesc, conv: ConvDesc, filt: TensorDesc) -> ConvSpec:
    """Validates a convolution against the plan's input and returns its resolved geometry."""
    if not isinstance(conv, ConvDesc):
        raise TypeError(f"add_conv_forward needs a ConvDesc, got {type(conv).__name__}")
    if not isinstance(filt, TensorDesc):
        raise TypeError(f"add_conv_forward needs a TensorDesc for the filter, got "
                        f"{type(filt).__name__}")
    layout = filter_layout(filt)
    if filt.ndim != 4 or layout not in FILTER_LAYOUTS:
        raise FusionError(f"filter descriptor must be 4-D in layout OIHW, HWIO or OHWI; got shape "
                          f"{filt.shape} layout {filt.layout!r}")
    # Filters in the plan's dtype, or float32 ones for a 16-bit plan (a model that keeps its
    # parameters in float32): the kernel rounds them to the plan's dtype as it loads them.
    wide = filt.dtype == np.float32 and input_desc.dtype != np.float32
    if filt.dtype != input_desc.dtype and not wide:
        raise TypeError(f"filter dtype {filt.dtype.name} differs from the plan's input dtype "
                        f"{input_desc.dtype.name} (filters are in the input's dtype, or "
                        f"float32 for a float16 or bfloat16 plan)")
    k, ci, r, s = (filt.shape[layout.index(a)] for a in "OIHW")
    c, g = input_desc.dim("C"), conv.groups
    if min(k, ci, r, s) < 1:
        raise FusionError(f"filter shape {filt.shape} ({layout}) has an empty dimension")
    if c % g or k % g:
        raise FusionError(f"groups={g} must divide the input channels ({c}) and the filter's "
                          f"output channels ({k})")
    if ci * g != c:
        raise FusionError(f"filter {filt.shape} ({layout}) has {ci} input channels per group; "
                          f"with groups={g} and {c} input channels it needs {c // g}")
    in_hw = (input_desc.dim("H"), input_desc.dim("W"))
    out_h, out_w = conv.output_hw(in_hw, (r, s))
    if out_h < 1 or out_w < 1:
        raise FusionError(f"convolution output would be empty ({out_h}x{out_w}): input {in_hw}, "
                          f"filter {r}x{s}, dilation {conv.dilation}, padding "
                          f"{conv.explicit_padding(in_hw, (r, s))}, strides {conv.strides}")
    return ConvSpec(out_channels=k, filter_h=r, filter_w=s, filter_layout=layout,
                    strides=conv.strides, padding=conv.explicit_padding(in_hw, (r, s)),
                    dilation=conv.dilation, groups=g, allow_tf32=conv.precision is None,
                    filter_dtype=filt.dtype if wide else None)


def supported_chains() -> list[str]:
    """Every operator chain a plan accepts, as letter strings (C, B, N, S, A)."""
    chains = []
    for size in range(0, len(POINTWISE) + 1):
        for perm in itertools.permutations(POINTWISE, size):
            tail = "".join(perm)
            chains += ["C" + tail] + ([tail] if tail else [])
    return sorted(chains, key=lambda c: (len(c), c))
