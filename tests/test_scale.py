"""Scale: tensors of more than 2^31 (and 2^32) elements index correctly, checked against the
float64 reference on sampled positions, including those around the 2^31 and 2^32 boundaries;
and memory (host RSS, device memory) stays flat over 10,000 executes.

The big tensors need a GPU (marked gpu) or, on the CPU, ``JAXFUSE_LARGE_TESTS=1`` and about
14 GiB of free memory (the biggest CPU case that fits a 24 GiB machine: 2^31 + 2^26 fp16
elements in and out).
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TOLERANCE, Case, relative_error, run_case
from jax import lax

import jaxfuse as jf
from jaxfuse._extension import FFI_TARGET
from jaxfuse.reference import reference_float64
from jaxfuse.signature import SCALARS

# ----- more than 2^31 elements ------------------------------------------------------------------

# (case, where it runs). Shapes keep each dimension small; only the products are huge.
BIG_CASES = [
    # Pointwise, NHWC, 2^31 + 2^26 elements: the CPU case (x and y: 4.4 GB each).
    (Case(ops="BA", dtype="float16", layout="NHWC", n=8, h=4096, w=4224, c=16,
          activation="leaky_relu"), "cpu"),
    (Case(ops="BSA", dtype="float16", layout="NHWC", n=8, h=4096, w=4224, c=16,
          activation="leaky_relu"), "gpu"),
    # Pointwise, NCHW, per-activation batch norm (parameter index = flat index % per-sample).
    (Case(ops="NA", dtype="float16", layout="NCHW", n=2176, c=4, h=512, w=512,
          bn_mode="per_activation", activation="elu"), "gpu"),
    # Pointwise past 2^32 elements (a 32-bit unsigned index would wrap too).
    (Case(ops="BNA", dtype="bfloat16", layout="NHWC", n=17, h=8192, w=2048, c=16,
          activation="tanh"), "gpu"),
    # 1x1 convolutions: tensor-core path (NHWC) and direct path (NCHW), > 2^31 in and out.
    (Case(ops="CBA", dtype="float16", layout="NHWC", filter_layout="HWIO", n=32, h=1024,
          w=1088, c=64, k=64, r=1, s=1, padding="VALID"), "gpu"),
    (Case(ops="CBNA", dtype="float16", layout="NCHW", filter_layout="OIHW", n=64, h=2048,
          w=2176, c=8, k=8, r=1, s=1, padding="VALID"), "gpu"),
]


def _big_params() -> list:
    params = []
    for case, where in BIG_CASES:
        elements = case.n * case.c * case.h * case.w
        assert elements > 2**31
        name = f"{case.ops}-{case.layout}-{case.dtype}-{elements / 2**31:.2f}x2^31"
        marks = [pytest.mark.gpu] if where == "gpu" else [pytest.mark.slow]
        params.append(pytest.param(case, where, id=name, marks=marks))
    return params


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def _device_for(where: str) -> Any:
    if where == "gpu":
        try:
            return jax.devices("gpu")[0]
        except RuntimeError:
            pytest.skip("no GPU visible to jax")
    if os.environ.get("JAXFUSE_LARGE_TESTS") != "1":
        pytest.skip("set JAXFUSE_LARGE_TESTS=1 to run (needs ~14 GiB of free memory)")
    if _mem_available() < 14 * 2**30:
        pytest.skip("needs ~14 GiB of free memory")
    return jax.devices("cpu")[0]


def _pseudo_random(shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    """Values in [-2, 2) from an integer hash of each element's coordinates. XLA fuses it into
    one elementwise loop, so it needs no memory beyond the result (jax.random needs about 16
    bytes per element, too much for billions of elements on a 24 GiB machine)."""
    def make() -> Any:
        h = jnp.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
        for axis in range(len(shape)):
            h = (h ^ lax.broadcasted_iota(jnp.uint32, shape, axis)) * jnp.uint32(0x85EBCA6B)
            h = h ^ (h >> 13)
        h = h * jnp.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
        return ((h >> 8).astype(jnp.float32) * (4.0 / 2**24) - 2.0).astype(dtype)

    return jax.jit(make)()


def _sample_pixels(case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(n, h, w) of pixels to check: those holding the first and last element and the flat
    indices around 2^31 and 2^32 (in input and output); and 2000 random ones."""
    n, c, h, w = case.n, case.c, case.h, case.w
    flat = [0, n * c * h * w - 1]
    for boundary in (2**31, 2**32):
        flat += [i for i in (boundary - 1, boundary, boundary + 1) if i < n * c * h * w]
    special = []
    for i in flat:
        if case.layout == "NHWC":
            special.append(np.unravel_index(i // c, (n, h, w)))
        else:
            b, _, y, x = np.unravel_index(i, (n, c, h, w))
            special.append((b, y, x))
    random = np.stack([rng.integers(0, n, 2000), rng.integers(0, h, 2000),
                       rng.integers(0, w, 2000)], axis=1)
    return np.asarray(special, np.int64), random


def _gather_pixels(a: Any, pixels: np.ndarray, layout: str) -> np.ndarray:
    """a[n, :, h, w] (or a[n, h, w, :]) for each pixel, as float64, shape (S, C) ."""
    idx = tuple(jnp.asarray(pixels[:, i], jnp.int32) for i in range(3))
    got = a[idx[0], :, idx[1], idx[2]] if layout == "NCHW" else a[idx[0], idx[1], idx[2], :]
    return np.asarray(jnp.asarray(got, jnp.float32), np.float64)


@pytest.mark.parametrize("case, where", _big_params())
def test_more_than_2_31_elements(case, where) -> None:
    device = _device_for(where)
    plan, handles = case.build()
    plan.compile(device)
    sig = plan.signature
    with jax.default_device(device):
        x = _pseudo_random(case.input_shape, case.dtype, seed=1)
        rng = np.random.default_rng(0)
        args = jf.OperatorArgs()
        params: dict[str, np.ndarray] = {}
        scalars = dict.fromkeys(SCALARS, 0.0)
        scalars.update(conv_alpha=1.0, side_alpha=1.0)
        z = None
        for letter, op in handles.items():
            if letter == "C":
                w = jnp.asarray(rng.standard_normal(sig.filter_shape) / np.sqrt(case.c),
                                case.dtype)
                params["w"] = np.asarray(jnp.asarray(w, jnp.float32))
                args.set_conv_forward(op, w, alpha=1.5)
                scalars["conv_alpha"] = 1.5
            elif letter == "B":
                params["bias"] = rng.standard_normal(sig.param_shape["bias"]).astype(np.float32)
                args.set_bias_forward(op, params["bias"])
            elif letter == "N":
                shape = sig.param_shape["batchnorm"]
                for name, lo, hi in (("scale", 0.5, 1.5), ("shift", -1, 1), ("mean", -0.3, 0.3),
                                     ("var", 0.5, 2.0)):
                    params[name] = rng.uniform(lo, hi, shape).astype(np.float32)
                args.set_batchnorm_inference(op, *(params[k] for k in ("scale", "shift", "mean",
                                                                        "var")), epsilon=1e-3)
                scalars["bn_epsilon"] = 1e-3
            elif letter == "S":
                z = _pseudo_random(sig.output_shape, case.dtype, seed=2)
                args.set_side_input_add(op, z, alpha=0.5)
                scalars["side_alpha"] = 0.5
            elif letter == "A":
                args.set_activation_forward(op, alpha=0.3, beta=1.1)
                scalars.update(act_alpha=0.3, act_beta=1.1, act_gamma=0.0)
        y = jax.jit(plan.execute)(x, args)
        y.block_until_ready()
        assert y.shape == sig.output_shape and y.dtype == sig.dtype

        special, random = _sample_pixels(case, rng)
        pixels = np.concatenate([special, random])
        if sig.bn_mode == "per_activation":
            # Whole samples (per-activation parameters cover one sample): those of the
            # boundary pixels and a few random ones.
            batches = np.unique(np.concatenate([special[:, 0], random[:4, 0]]))
            xs = np.asarray(jnp.asarray(x[jnp.asarray(batches)], jnp.float32), np.float64)
            ys = np.asarray(jnp.asarray(y[jnp.asarray(batches)], jnp.float32), np.float64)
            small = dataclasses.replace(sig, batch=len(batches))
            operands = [xs]
        else:  # whole pixels (all channels) as a batch of 1x1 images
            xs = _gather_pixels(x, pixels, case.layout)
            ys = _gather_pixels(y, pixels, case.layout)
            small = dataclasses.replace(sig, batch=len(pixels), height=1, width=1)
            as_image = (lambda a: a[:, :, None, None]) if case.layout == "NCHW" else (
                lambda a: a[:, None, None, :])
            xs, ys = as_image(xs), as_image(ys)
            operands = [xs]
        for spec in small.operands[1:-1]:
            if spec.name == "side":
                assert z is not None
                zs = _gather_pixels(z, pixels, case.layout)
                operands.append(zs[:, :, None, None] if case.layout == "NCHW" else
                                zs[:, None, None, :])
            else:
                operands.append(params[spec.name].astype(np.float64))
        operands.append(np.asarray([scalars[k] for k in SCALARS], np.float32).astype(np.float64))
        ref = reference_float64(small, *operands)
        err = relative_error(ys, ref)
        assert err <= TOLERANCE[np.dtype(jnp.dtype(case.dtype))], err
    del x, y, z
    gc.collect()


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_channels_wider_than_a_cpu_chunk(layout, device) -> None:
    # The CPU backend works on 2048 values at a time; a pixel's channels may be many more.
    run_case(Case(ops="BNSA", layout=layout, n=2, c=5000, h=3, w=2, activation="elu"), device)
    run_case(Case(ops="CBA", layout=layout, filter_layout="HWIO", n=1, c=2100, k=2060, h=2,
                  w=3, r=1, s=1, padding="VALID"), device)


# ----- memory stays flat over 10,000 executes ---------------------------------------------------

EXECUTES = 10_000
SMALL = Case(ops="CBNA", c=16, k=16, h=32, w=32, n=1)  # 64 KB out, 74 KB of CPU scratch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _executes(device: Any) -> tuple[Any, Any, Any, Any]:
    plan, handles = SMALL.build()
    plan.compile(device)
    x, args, _ = SMALL.random_args(plan, handles, np.random.default_rng(0))
    x, args = jax.device_put((x, args), device)
    return plan, jax.jit(plan.execute), x, args


def _loop(plan: Any, run: Any, x: Any, args: Any, count: int) -> None:
    y = None
    for i in range(count):
        # Mostly jitted; every tenth call eager (its own dispatch path).
        y = plan.execute(x, args) if i % 10 == 0 else run(x, args)
        if i % 500 == 0:
            y.block_until_ready()
    y.block_until_ready()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_host_memory_flat_over_10000_executes() -> None:
    device = jax.devices("cpu")[0]
    plan, run, x, args = _executes(device)
    _loop(plan, run, x, args, 500)  # warm-up: compiles, caches, allocator pools
    gc.collect()
    before = _rss_bytes()
    _loop(plan, run, x, args, EXECUTES)
    # Failing calls too: a handler error must not leak what it allocated.
    sig = plan.signature
    bad = jax.jit(lambda *ops: jax.ffi.ffi_call(
        FFI_TARGET, jax.ShapeDtypeStruct(sig.output_shape, sig.dtype))(*ops, plan=sig.encode()))
    ops = [jnp.ones(s.shape, s.dtype) for s in sig.operands[:-1]]
    for _ in range(1000):
        with pytest.raises(RuntimeError, match="takes 8 operands"):
            bad(*ops)
    gc.collect()
    grown = _rss_bytes() - before
    # A leaked output or scratch buffer per call would be >= 640 MB; allow allocator noise.
    assert grown < 16 * 2**20, f"host RSS grew by {grown / 2**20:.1f} MiB"


@pytest.mark.gpu
def test_device_memory_flat_over_10000_executes() -> None:
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("no GPU visible to jax")
    plan, run, x, args = _executes(device)
    _loop(plan, run, x, args, 500)
    gc.collect()
    stats = device.memory_stats()
    if not stats or "bytes_in_use" not in stats:
        pytest.skip("the device reports no memory statistics")
    before_device, before_host = stats["bytes_in_use"], _rss_bytes()
    _loop(plan, run, x, args, EXECUTES)
    gc.collect()
    grown_device = device.memory_stats()["bytes_in_use"] - before_device
    grown_host = _rss_bytes() - before_host
    assert grown_device <= 2**20, f"device memory grew by {grown_device / 2**20:.1f} MiB"
    assert grown_host < 32 * 2**20, f"host RSS grew by {grown_host / 2**20:.1f} MiB"
