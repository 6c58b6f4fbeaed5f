"""The CPU backend's scratch is bounded by its tensors: a convolution whose zero-padded input
copy would be far larger than x, w and y together (huge padding that strides or dilation mostly
skip) runs the direct path (csrc/cpu/conv_direct_cpu.cc, kernel_info solver "cpu_direct"),
which reads only the taps inside the input; ordinary padding keeps the implicit GEMM ("cpu").
Both against float64 references; memory measured in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
from cases import Case, run_case

CPU = jax.devices("cpu")[0]


def _solver(case: Case) -> str:
    plan, _ = case.build()
    plan.compile(CPU)
    return plan.kernel_info["solver"]


def _outputs_reading_input(case: Case) -> int:
    """Output pixels (of one image) whose window has a tap inside the input."""
    (pt, pb), (pl, pr) = case.padding
    counts = []
    for size, r, stride, dil, lo, hi in ((case.h, case.r, case.strides[0], case.dilation[0],
                                          pt, pb),
                                         (case.w, case.s, case.strides[1], case.dilation[1],
                                          pl, pr)):
        out = (size + lo + hi - (r - 1) * dil - 1) // stride + 1
        counts.append(sum(any(0 <= o * stride - lo + t * dil < size for t in range(r))
                          for o in range(out)))
    return counts[0] * counts[1]


# Padding in the hundreds that strides or dilation mostly skip: some outputs read the input
# through some of their taps (the window's edges, dilated taps), most read padding only.
# (Sizes keep the float64 reference's own padded copy small.)
DIRECT_CASES = [
    Case(ops="CBNSA", n=2, c=2, k=3, h=30, w=36, strides=(3, 4),
         padding=((600, 590), (610, 620))),
    Case(ops="CNA", dtype="float16", layout="NHWC", filter_layout="HWIO", groups=2, c=4, k=6,
         h=7, w=5, strides=(90, 110), dilation=(40, 50), padding=((254, 244), (266, 276)),
         activation="elu"),
    # Depthwise.
    Case(ops="CBA", dtype="bfloat16", layout="NHWC", filter_layout="OHWI", groups=8, c=8, k=8,
         h=24, w=24, strides=(3, 3), padding=((400, 400), (400, 390)),
         activation="leaky_relu"),
    # Negative padding (a crop) on one side, huge on the other.
    Case(ops="CBA", filter_layout="OHWI", n=1, c=3, k=5, h=6, w=7, strides=(200, 150),
         padding=((-2, 700), (600, -1)), activation="clipped_relu"),
    # A large filter mostly over padding, per-activation batch norm.
    Case(ops="CNA", layout="NHWC", n=1, c=2, k=3, h=3, w=2, r=40, s=30, strides=(100, 120),
         padding=((598, 578), (599, 619)), bn_mode="per_activation", activation="tanh"),
    # More output channels than one epilogue block holds for a whole row.
    Case(ops="CBNA", n=1, c=1, k=3000, h=2, w=3, r=1, s=1, strides=(200, 200),
         padding=((799, 799), (798, 798))),
    Case(ops="CBNA", layout="NHWC", filter_layout="HWIO", n=1, c=1, k=3000, h=2, w=3, r=1,
         s=1, strides=(200, 200), padding=((799, 799), (798, 798)), dtype="float16"),
]


@pytest.mark.parametrize("case", DIRECT_CASES, ids=str)
def test_direct_path_matches_the_reference(case: Case) -> None:
    assert _solver(case) == "cpu_direct"
    assert _outputs_reading_input(case) > 0
    for seed in (0, 1):
        run_case(case, CPU, seed=seed)


# ResNet and dilated "SAME" layers, and small problems with any padding, keep the fast path.
FAST_CASES = [
    Case(n=32, c=64, k=64, h=56, w=56, padding="SAME"),
    Case(n=32, c=3, k=64, h=224, w=224, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)),
         layout="NHWC", filter_layout="HWIO"),
    Case(n=32, c=256, k=512, h=56, w=56, r=1, s=1, strides=(2, 2), padding="VALID"),
    Case(n=8, c=64, k=64, h=28, w=28, dilation=(4, 4), padding="SAME"),
    Case(n=1, c=1, k=1, h=1, w=1, padding=((100, 100), (100, 100))),
]


@pytest.mark.parametrize("case", FAST_CASES, ids=str)
def test_ordinary_padding_keeps_the_implicit_gemm(case: Case) -> None:
    assert _solver(case) == "cpu"


# The geometry (a tiny input, a 200x200 filter, stride 800, padding ~7000: a 0.9 GB
# padded copy) and one 25 times larger (1000x1000 filter, stride 4000: 24 GB), each against a
# float64 reference that visits only the taps inside the input.
_CHILD = r"""
import resource, sys
import numpy as np
import jax.numpy as jnp
import jaxfuse as jf

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def reference(x, w, stride, pad, b):
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    oh, ow = ((size + 2 * pad - r) // stride + 1 for size in (h, wd))
    out = np.zeros((n, k, oh, ow))
    for oy in range(oh):
        for ox in range(ow):
            y0, x0 = oy * stride - pad, ox * stride - pad
            ys = slice(max(0, -y0), min(r, h - y0)); xs = slice(max(0, -x0), min(s, wd - x0))
            if ys.start < ys.stop and xs.start < xs.stop:
                patch = x[:, :, y0 + ys.start:y0 + ys.stop, x0 + xs.start:x0 + xs.stop]
                out[:, :, oy, ox] = np.einsum("nchw,kchw->nk", patch, w[:, :, ys, xs])
    return out + b[None, :, None, None]

rng = np.random.default_rng(0)
jf.conv_bias_activation(jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 3, 3)), None, padding="SAME",
                        activation=None).block_until_ready()  # jax and the extension loaded
for r, stride, c, k in ((200, 800, 1, 1), (1000, 4000, 2, 3)):
    pad = 9 * stride + r // 3  # output 9's window starts a third of the filter before the input
    x = rng.standard_normal((1, c, 2, 3)).astype(np.float32)
    w = rng.standard_normal((k, c, r, r)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    before = peak_mib()
    y = jf.conv_bias_activation(x, w, b, window_strides=(stride, stride),
                                padding=((pad, pad), (pad, pad)), activation=None)
    y = np.asarray(y.block_until_ready(), np.float64)
    grew = peak_mib() - before
    want = reference(x.astype(np.float64), w.astype(np.float64), stride, pad, b)
    err = np.linalg.norm(y - want) / np.linalg.norm(want)
    print(r, stride, y.shape, f"{grew:.0f}", f"{err:.3g}", flush=True)
    assert y.shape == want.shape and (want != b[:, None, None]).any()
    assert err < 1e-5, err
    assert grew < 64, f"peak RSS grew by {grew:.0f} MiB"
print("ok")
"""


def test_scratch_is_bounded_by_the_tensors() -> None:
    env = dict(os.environ, JAXFUSE_CACHE_DIR="")
    done = subprocess.run([sys.executable, "-P", "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-3000:])
