"""Inference functions close over their variables: ``jax.jit(lambda x: fuse(apply)(variables,
x))``. Whatever ``jaxfuse.fuse`` can compute from values known when the program is traced (the
batch norm's statistics folded, filters converted to the computation dtype, per-channel
vectors reshaped) is computed then, once, instead of on every call: the compiled program
keeps the fused calls and the work on its input. Results match the same function taking its
variables as arguments up to the rounding of the prepared parameters: computed op by op at
trace time rather than fused by XLA, a folded batch-norm factor may differ in its last bit
(bit for bit on the CPU; on an H100 one bf16 ulp in some outputs, carried through the
layers)."""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxfuse as jf

BF16 = jnp.bfloat16
HWIO = ("NHWC", "HWIO", "NHWC")


def _variables(seed: int = 0, c: int = 8) -> dict[str, Any]:
    """float32 variables of three conv -> batch norm -> relu layers (Flax's param_dtype)."""
    rng = np.random.default_rng(seed)
    layers = []
    for cin in (4, c, c):
        layers.append({
            "w": rng.standard_normal((3, 3, cin, c)).astype(np.float32) / np.sqrt(9 * cin),
            "scale": rng.uniform(0.5, 1.5, c).astype(np.float32),
            "bias": rng.standard_normal(c).astype(np.float32),
            "mean": rng.standard_normal(c).astype(np.float32),
            "var": rng.uniform(0.5, 2.0, c).astype(np.float32),
        })
    return jax.tree.map(jnp.asarray, {"layers": layers})


def apply(variables: dict[str, Any], x: jax.Array) -> jax.Array:
    """bfloat16 computation with float32 variables, batch norm written as Flax computes it."""
    for p in variables["layers"]:
        y = lax.conv_general_dilated(x, p["w"].astype(BF16), (1, 1), "SAME",
                                     dimension_numbers=HWIO)
        factor = (p["scale"] * lax.rsqrt(p["var"] + 1e-5)).reshape(1, 1, 1, -1)
        y = (y - p["mean"].reshape(1, 1, 1, -1).astype(BF16)) * factor.astype(BF16)
        x = jax.nn.relu(y + p["bias"].reshape(1, 1, 1, -1).astype(BF16))
    return x


def _input(seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((2, 9, 9, 4)), BF16)


def _assert_matches(got: jax.Array, want: jax.Array) -> None:
    """Relative L2 error within 1e-2 (bf16 tests allow 2.5e-2): last-bit flips only."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error <= 1e-2, f"relative error {error:.3g}"


def _primitives(fn: Any, *args: Any) -> collections.Counter[str]:
    (jit_eqn,) = jax.make_jaxpr(fn)(*args).eqns
    return collections.Counter(e.primitive.name for e in jit_eqn.params["jaxpr"].jaxpr.eqns)


def test_closed_over_variables_are_prepared_once_at_trace_time(device) -> None:
    variables, x = jax.device_put((_variables(), _input()), device)
    fused = jf.fuse(apply, solver="fused")
    closed = jax.jit(lambda x: fused(variables, x))
    as_arguments = jax.jit(fused)
    per_call = _primitives(closed, x)
    # three fused calls (each in its differentiation wrapper) and nothing else
    assert per_call == collections.Counter({"custom_jvp_call": 3}), per_call
    # with the variables as arguments the same preparation runs on every call
    assert _primitives(as_arguments, variables, x)["jaxfuse_convert_many"] == 1
    with jax.default_device(device):
        got, want = np.asarray(closed(x)), np.asarray(as_arguments(variables, x))
        plain = np.asarray(jax.jit(apply)(variables, x), np.float64)
    _assert_matches(got, want)
    np.testing.assert_allclose(np.asarray(got, np.float64), plain, rtol=2e-2, atol=2e-2)


def test_closed_over_and_passed_filters_mix(device) -> None:
    """Filters known at trace time are converted then; the ones passed in, in the program."""
    variables, x = jax.device_put((_variables(seed=2), _input(seed=3)), device)
    fused = jf.fuse(apply, solver="fused")

    def half_closed(first: dict[str, Any], x: jax.Array) -> jax.Array:
        return fused({"layers": [first, *variables["layers"][1:]]}, x)

    program = jax.jit(half_closed)
    first = variables["layers"][0]
    ops = _primitives(program, first, x)
    assert ops["custom_jvp_call"] == 3 and ops["jaxfuse_convert_many"] <= 1
    with jax.default_device(device):
        got = np.asarray(program(first, x))
        want = np.asarray(jax.jit(fused)(variables, x))
    _assert_matches(got, want)


def test_effects_on_known_values_stay_in_the_program() -> None:
    """A callback on a closed-over value runs on every call, not once when tracing."""
    variables, x = _variables(seed=4), _input(seed=5)
    seen = []

    def apply_logged(variables: dict[str, Any], x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda m: seen.append(float(m)), variables["layers"][0]["mean"][0])
        return apply(variables, x)

    fused = jf.fuse(apply_logged, solver="fused")
    program = jax.jit(lambda x: fused(variables, x))
    jax.block_until_ready(program(x))
    jax.block_until_ready(program(x))
    jax.effects_barrier()
    assert len(seen) == 2, seen


def test_known_broadcasts_to_large_shapes_stay_in_the_program() -> None:
    """A scalar broadcast to an activation's shape is not made a constant: XLA fuses it into
    its users for free, where a constant would be read on every call."""
    variables, x = _variables(seed=6), _input(seed=7)
    fused = jf.fuse(lambda v, x: jnp.minimum(apply(v, x), jnp.full((2, 9, 9, 8), 0.5, BF16)),
                    solver="fused")
    ops = _primitives(jax.jit(lambda x: fused(variables, x)), x)
    assert ops["broadcast_in_dim"] == 1 and ops["custom_jvp_call"] == 3, ops
