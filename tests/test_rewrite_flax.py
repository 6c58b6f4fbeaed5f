"""jaxfuse.fuse on Flax code: linen and nnx Conv + BatchNorm (inference) + activations, and
whole networks (ResNet-50, MobileNetV2) where every convolution chain must be fused."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rewrite import DTYPES, check, tolerance

import jaxfuse as jf

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
models = pytest.importorskip("jaxfuse.bench.models")


class _LinenBlock(nn.Module):
    dtype: Any
    use_bias: bool
    activation: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.Conv(6, (3, 3), strides=(2, 2), use_bias=self.use_bias, dtype=self.dtype)(x)
        y = nn.BatchNorm(use_running_average=True, dtype=self.dtype)(y)
        return self.activation(y)


LINEN_CASES = [
    (dtype, use_bias, act)
    for dtype in DTYPES
    for use_bias, act in ((True, nn.relu), (False, nn.relu6), (True, nn.swish), (False, nn.tanh))
]


@pytest.mark.parametrize(("dtype", "use_bias", "activation"), LINEN_CASES,
                         ids=[f"{d}-bias{b}-{a.__name__}" for d, b, a in LINEN_CASES])
def test_linen_conv_batchnorm(dtype: str, use_bias: bool, activation: Any) -> None:
    module = _LinenBlock(jnp.dtype(dtype), use_bias, activation)
    x = jax.random.normal(jax.random.key(0), (2, 10, 10, 4), dtype)
    variables = models.random_variables(module, x, seed=1)
    plan = ("CB" if use_bias else "C") + "NA"
    report = check(module.apply, variables, x, plans=[plan], dtype=dtype)
    assert report.fused[0].where.startswith("_LinenBlock/Conv_0")
    if activation is nn.swish:
        assert report.fused[0].ops[-1] == "silu"


def test_linen_batchnorm_promoting_to_float32() -> None:
    # dtype=None: batch norm computes and returns float32 from a bfloat16 convolution; the fused
    # call rounds its result to bfloat16 once, then widens it.
    module = _LinenBlock(None, True, nn.relu)
    x = jax.random.normal(jax.random.key(0), (2, 10, 10, 4), jnp.bfloat16)
    variables = models.random_variables(module, x, seed=2)
    check(module.apply, variables, x, plans=["CBNA"], dtype="bfloat16")


class _NnxBlock(nnx.Module):
    def __init__(self, dtype: Any, rngs: nnx.Rngs):
        self.conv = nnx.Conv(4, 8, (3, 3), dtype=dtype, rngs=rngs)
        self.norm = nnx.BatchNorm(8, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.leaky_relu(self.norm(self.conv(x)), 0.05)


def _randomize_norm(block: nnx.Module, seed: int) -> nnx.Module:
    """The block with random batch-norm statistics, scale and shift (fresh ones are identities)."""
    graphdef, state = nnx.split(block)
    rng = np.random.default_rng(seed)

    def draw(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        keys = [str(getattr(k, "key", k)) for k in path]
        if "norm" not in keys:
            return leaf
        if "var" in keys or "scale" in keys:
            return jnp.asarray(rng.uniform(0.5, 1.5, leaf.shape), leaf.dtype)
        return jnp.asarray(0.3 * rng.standard_normal(leaf.shape), leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_conv_batchnorm_eval(dtype: str) -> None:
    block = _randomize_norm(_NnxBlock(jnp.dtype(dtype), nnx.Rngs(0)), seed=3)
    block.eval()
    x = jax.random.normal(jax.random.key(1), (2, 9, 9, 4), dtype)
    check(block, x, plans=["CBNA"], dtype=dtype)
    graphdef, state = nnx.split(block)
    check(lambda s, x: nnx.merge(graphdef, s)(x), state, x, plans=["CBNA"], dtype=dtype)


NETWORKS = {
    "resnet50": lambda dtype: models.resnet50(width=8, num_classes=10, dtype=dtype),
    "mobilenet": lambda dtype: models.mobilenet(width_multiplier=0.35, num_classes=10,
                                                dtype=dtype),
}


def _relative_error(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_every_chain_of_a_network_is_fused(name: str, dtype: str) -> None:
    model = NETWORKS[name](jnp.dtype(dtype))
    # 64x64 keeps every stage above 1x1 pixels, where a residual looks like a per-channel add.
    x = jax.random.normal(jax.random.key(0), (1, 64, 64, 3), dtype)
    variables = models.random_variables(model, x, seed=4)
    original = jax.make_jaxpr(model.apply)(variables, x)
    convs = sum(e.primitive.name == "conv_general_dilated" for e in original.jaxpr.eqns)
    report = jf.fusion_report(model.apply, variables, x)
    assert not report.left_alone, report
    assert len(report.fused) == convs == report.fused_calls
    assert not any(e.primitive.name == "conv_general_dilated" for e in report.jaxpr.jaxpr.eqns)
    if name == "resnet50":  # every bottleneck's tail is relu(bn(conv(x)) + shortcut)
        assert sum(g.plan == "CNSA" for g in report.fused) == 16
    ref = jax.jit(model.apply)(variables, x)
    out = jax.jit(jf.fuse(model.apply))(variables, x)
    if dtype == "float32":
        assert _relative_error(out, ref) <= tolerance(dtype)
    else:
        # Fifty layers of bfloat16 rounding make both programs drift from the float32 network by
        # more than one layer's tolerance; the fused one (which rounds once per chain) must not
        # drift further than the original does.
        truth = jax.jit(NETWORKS[name](jnp.float32).apply)(variables, x.astype(jnp.float32))
        assert _relative_error(out, truth) <= 1.25 * _relative_error(ref, truth) + \
            tolerance(dtype)


def _hlo_ops(fn: Any, *args: Any) -> list[str]:
    """The optimized program's instruction names (opcodes), fusion bodies included."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [line.split("=", 1)[1].split("(", 1)[0].split()[-1]
            for line in text.splitlines() if " = " in line and "(" in line]


@pytest.mark.parametrize("written", ["flax", "by hand"])
def test_batchnorm_statistics_reach_the_kernel_as_they_are(written: str) -> None:
    """No per-call kernels fold the statistics before the fused call: the kernel takes scale,
    mean, variance and epsilon as they are (flax's scale * rsqrt(var + eps), or a hand-written
    scale / sqrt(var + eps)), and the folded vector the program computed is dead."""
    import flax.linen as nn

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 9, 9, 8)), jnp.float32)
    if written == "flax":
        class Block(nn.Module):
            @nn.compact
            def __call__(self, x):
                y = nn.Conv(16, (3, 3), use_bias=False)(x)
                return nn.relu(nn.BatchNorm(use_running_average=True)(y))

        model = Block()
        variables = model.init(jax.random.key(0), x)
        stats = variables["batch_stats"]["BatchNorm_0"]
        stats["var"] = jnp.asarray(rng.uniform(0.5, 2.0, 16), jnp.float32)
        stats["mean"] = jnp.asarray(rng.standard_normal(16), jnp.float32)
        fn, args = model.apply, (variables, x)
    else:
        w = jnp.asarray(rng.standard_normal((3, 3, 8, 16)) / 9, jnp.float32)
        scale, shift, mean = (jnp.asarray(rng.standard_normal(16), jnp.float32) for _ in "abc")
        var = jnp.asarray(rng.uniform(0.5, 2.0, 16), jnp.float32)

        def fn(x, w, scale, shift, mean, var):
            y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu(scale * (y - mean) / jnp.sqrt(var + 1e-3) + shift)

        args = (x, w, scale, shift, mean, var)
    fused = jf.fuse(fn, solver="fused")
    assert jf.fusion_report(fused, *args).fused_calls == 1
    ops = _hlo_ops(fused, *args)
    assert ops.count("custom-call") == 1
    assert not {"rsqrt", "sqrt", "divide", "broadcast"} & set(ops), ops
    np.testing.assert_allclose(fused(*args), fn(*args), rtol=1e-5, atol=1e-5)
