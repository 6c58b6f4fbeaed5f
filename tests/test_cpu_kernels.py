"""The CPU backend's code paths (csrc/cpu/), each against the float64 reference: register tiles
of one and two output rows and every tile width, partial channel blocks, filters read in place,
copied per task (large, or float16 / bfloat16) or packed, inputs read in place or padded, NCHW
rows gathered across tiles, and the conv-less pass in its single-pass and staged forms.

The tile shapes depend on the vector width the machine has; the narrower widths (AVX2, and the
portable code every other machine runs) are checked too, in a subprocess that caps the width
with JAXFUSE_CPU_ISA."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from cases import Case, run_case

NHWC = {"layout": "NHWC", "filter_layout": "HWIO"}

CONV_CASES = [
    # Filters over 512 KiB, HWIO float32: read in place, copied per task. 5 columns make
    # two-row tiles on AVX-512 (and an odd row count leaves one row alone).
    Case(c=128, k=128, n=1, h=5, w=5, **NHWC),
    # ... 1x1 stride 2 read straight from the unpadded input, 9 channel blocks split in tasks.
    Case(c=512, k=288, r=1, s=1, strides=(2, 2), padding="VALID", n=2, h=13, w=13,
         ops="CBNSA", **NHWC),
    # float16 / bfloat16 HWIO filters converted in the per-task copy; one block and several.
    Case(c=24, k=32, h=6, w=17, dtype="float16", **NHWC),
    Case(c=8, k=32, n=2, h=3, w=5, dtype="float16", ops="CBNSA", **NHWC),
    Case(c=64, k=96, h=5, w=15, dtype="bfloat16", ops="CNA", **NHWC),
    # 16-bit conv epilogues from float32 tiles through pass16 (NHWC: a row per pixel; NCHW:
    # a row per channel).
    Case(c=8, k=40, n=1, h=5, w=7, dtype="bfloat16", ops="CBNSA", activation="clipped_relu",
         **NHWC),
    Case(c=8, k=12, n=2, h=5, w=7, dtype="float16", ops="CNA", activation="hardswish"),
    # Rows split into tiles of unequal widths (29 = 10 + 10 + 9 on AVX-512, 5 x 6 on AVX2).
    Case(c=16, k=64, h=4, w=29, **NHWC),
    Case(c=16, k=64, h=4, w=29, ops="CBNSA", dtype="float16"),
    # NCHW rows longer than the gathering buffer (64 pixels) and shorter than a tile.
    Case(c=8, k=40, n=1, h=3, w=150),
    Case(c=8, k=24, n=3, h=5, w=3, filter_layout="OHWI"),
    # Output channels that leave the last block partial, in place impossible: packed.
    Case(c=16, k=40, **NHWC),
    Case(c=12, k=33, layout="NHWC", filter_layout="OIHW", ops="CBA", activation="leaky_relu"),
    # Groups narrower than a vector (one vector of channels per tile) and wider.
    Case(groups=4, c=16, k=64, **NHWC),
    Case(groups=8, c=32, k=16, dilation=(1, 2), padding="SAME"),
    Case(groups=2, c=8, k=12, r=1, s=1, padding="VALID", **NHWC),
    # float32 NHWC read in place: negative padding only crops.
    Case(padding=((-1, 0), (0, -2)), h=10, w=12, **NHWC),
    # 1x1 with padding (copied), and strided 1x1 in NCHW.
    Case(r=1, s=1, padding=((1, 0), (0, 1)), k=16, **NHWC),
    Case(r=1, s=1, strides=(2, 2), padding="VALID", k=16, h=11, w=11),
    # Stem-like: three input channels, 7x7, stride 2.
    Case(c=3, k=64, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)), h=30, w=30,
         dtype="bfloat16", **NHWC),
    # Depthwise, NHWC and NCHW, channels not a multiple of the vector.
    Case(groups=20, c=20, k=20, h=9, w=11, strides=(2, 2), padding="SAME", **NHWC),
    Case(groups=20, c=20, k=20, h=9, w=11, dtype="float16"),
]

POINTWISE_CASES = [
    # Single pass straight from the input: channels wider than a block (split in pieces),
    # planes wider than a block, every fast activation, with and without the side input.
    Case(ops="NA", c=20000, n=2, h=1, w=1, layout="NHWC"),
    Case(ops="BNSA", c=3, n=1, h=130, w=130, activation="clipped_relu", dtype="float16"),
    Case(ops="NSA", c=40, n=2, h=7, w=9, layout="NHWC", activation="leaky_relu"),
    Case(ops="BA", c=40, n=2, h=7, w=9, activation="passthru", dtype="bfloat16"),
    # float16 rows back to back in the output, converted several at a time.
    Case(ops="NSA", c=5, n=2, h=6, w=7, dtype="float16"),
    Case(ops="BA", c=16, n=3, h=3, w=4, layout="NHWC", dtype="float16", activation="leaky_relu"),
    # float16 / bfloat16 converted in vector registers (pass16): NHWC pixels of whole vectors
    # and a partial one (40 = 16 + 16 + 8 on AVX-512, 5 x 8 on AVX2), NCHW planes with a
    # partial vector (63 values), side inputs, every fast activation.
    Case(ops="NSA", c=40, n=2, h=3, w=5, layout="NHWC", dtype="float16", activation="hardswish"),
    Case(ops="BNA", c=48, n=1, h=4, w=4, layout="NHWC", dtype="bfloat16",
         activation="hardsigmoid"),
    Case(ops="NA", c=6, n=2, h=7, w=9, dtype="bfloat16", activation="leaky_relu"),
    Case(ops="NSA", c=5, n=1, h=5, w=7, dtype="float16", activation="passthru"),
    Case(ops="BSA", c=24, n=1, h=7, w=9, layout="NHWC", dtype="bfloat16", activation="relu"),
    # Staged through L1: chains the single pass does not take, some wider than a block.
    Case(ops="NA", c=5000, n=2, h=1, w=2, layout="NHWC", activation="tanh"),
    Case(ops="AB", c=3, n=1, h=70, w=70, activation="elu"),
    Case(ops="NA", c=24, h=6, w=7, bn_mode="per_activation", layout="NHWC"),
    Case(ops="SAN", c=24, h=6, w=7, bn_mode="per_activation", dtype="float16"),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_paths(case: Case) -> None:
    run_case(case, jax.devices("cpu")[0])


@pytest.mark.parametrize("activation", ["passthru", "relu", "clipped_relu", "leaky_relu"])
@pytest.mark.parametrize("ops", ["CBA", "CNSA"])
def test_single_pass_tile_store(ops: str, activation: str) -> None:
    # NHWC float32 full channel blocks go from registers to the output in one pass.
    run_case(Case(ops=ops, activation=activation, c=8, k=64, h=5, w=9, **NHWC),
             jax.devices("cpu")[0])


@pytest.mark.parametrize("case", POINTWISE_CASES, ids=str)
def test_pointwise_paths(case: Case) -> None:
    run_case(case, jax.devices("cpu")[0])


def test_large_layer_other_dtypes() -> None:
    # A ResNet layer-4 shape (in-place filter copy across tasks, two-row tiles) in half precision.
    for dtype in ("float16", "bfloat16"):
        run_case(Case(c=256, k=256, n=2, h=7, w=7, dtype=dtype, **NHWC), jax.devices("cpu")[0])


_SCRIPT = """
import dataclasses, sys
import jax
sys.path.insert(0, {tests!r})
from cases import run_case
from test_cpu_kernels import CONV_CASES, POINTWISE_CASES
from test_plans import GEOMETRY_CASES
cpu = jax.devices("cpu")[0]
for case in CONV_CASES + POINTWISE_CASES + GEOMETRY_CASES:
    run_case(case, cpu)
run_case(dataclasses.replace(GEOMETRY_CASES[2], dtype="bfloat16", layout="NHWC",
                             filter_layout="HWIO"), cpu)
print("ok")
"""


@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_narrower_vector_widths(level: str) -> None:
    env = dict(os.environ, JAXFUSE_CPU_ISA=level, JAXFUSE_POISON_OUTPUTS="1")
    script = _SCRIPT.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_concurrent_calls() -> None:
    # Several host threads run plans at once (as several XLA threads may): each gets the same
    # result as it does alone. The conv copies its filters into per-thread scratch.
    import threading

    import numpy as np

    cpu = jax.devices("cpu")[0]
    cases = [Case(c=128, k=128, n=1, h=5, w=5, **NHWC), Case(c=16, k=64, h=4, w=29),
             Case(ops="NA", c=64, n=2, h=9, w=9, layout="NHWC")]
    runs = []
    for i, case in enumerate(cases):
        plan, handles = case.build()
        plan.compile(cpu)
        x, args, _ = case.random_args(plan, handles, np.random.default_rng(i))
        fn = jax.jit(plan.execute)
        runs.append((fn, x, args, np.asarray(fn(x, args))))
    failures = []

    def worker(k: int) -> None:
        fn, x, args, expected = runs[k % len(runs)]
        for _ in range(5):
            if not np.array_equal(np.asarray(fn(x, args)), expected):
                failures.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_case_list_is_distinct() -> None:
    # Every case above exercises something; duplicates would only cost time.
    assert len({dataclasses.astuple(c) for c in CONV_CASES + POINTWISE_CASES}) == len(
        CONV_CASES + POINTWISE_CASES)
