"""The side-input (residual add) operator: ``y + alpha * z`` fused before the activation, against
the float64 reference, and every misuse of it raising a clear exception."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, relative_error, run_case

import jaxfuse as jf
from jaxfuse.reference import reference_float64
from jaxfuse.signature import SCALARS

SIDE_CASES = [
    Case(ops=ops, dtype=dtype, layout=layout, filter_layout=fl, activation=act)
    for ops, act in (("CBNSA", "relu"), ("CNSA", "elu"), ("CS", "relu"), ("CSA", "tanh"),
                     ("SA", "clipped_relu"), ("NS", "relu"))
    for dtype in ("float32", "float16", "bfloat16")
    for layout, fl in (("NCHW", "OIHW"), ("NHWC", "HWIO"))
]


@pytest.mark.parametrize("case", SIDE_CASES, ids=str)
def test_side_input_chains(case: Case, device) -> None:
    run_case(case, device)


@pytest.mark.parametrize("case", [Case(ops="CBSA", strides=(2, 2), padding="SAME", k=16),
                                  Case(ops="CSA", groups=8, c=8, k=8, layout="NHWC",
                                       filter_layout="HWIO")], ids=str)
def test_side_input_with_strided_and_depthwise_conv(case: Case, device) -> None:
    run_case(case, device)


def _side_plan(dtype: str = "float32") -> tuple[jf.FusionPlan, dict[str, object]]:
    return Case(ops="CSA", dtype=dtype, n=1, c=4, h=6, w=6, k=5).build()


@pytest.mark.parametrize("alpha", [-1.0, 0.0, 2.5])
def test_side_alpha_values_and_traced_alpha(alpha: float) -> None:
    plan, handles = _side_plan()
    plan.compile()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(plan.input_desc.shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 4, 3, 3)) / 6, jnp.float32)
    z = jnp.asarray(rng.standard_normal(plan.output_desc.shape), jnp.float32)

    def run(alpha: jax.Array) -> jax.Array:
        args = jf.OperatorArgs().set_conv_forward(handles["C"], w)
        args.set_side_input_add(handles["S"], z, alpha=alpha)
        args.set_activation_forward(handles["A"])
        return plan.execute(x, args)

    scalars = dict.fromkeys(SCALARS, 0.0)
    scalars.update(conv_alpha=1.0, side_alpha=alpha)
    operands = [np.asarray(a, np.float64) for a in (x, w, z)]
    operands.append(np.asarray([scalars[k] for k in SCALARS], np.float64))
    ref = reference_float64(plan.signature, *operands)
    for out in (run(alpha), jax.jit(run)(jnp.float32(alpha))):  # concrete, then traced alpha
        assert relative_error(out, ref) <= Case().tolerance(jax.devices()[0])


def test_side_input_errors() -> None:
    plan, handles = _side_plan("float16")
    plan.compile()
    x = jnp.ones(plan.input_desc.shape, jnp.float16)
    w = jnp.ones((5, 4, 3, 3), jnp.float16)
    out_shape = plan.output_desc.shape

    def execute(**side: object) -> jax.Array:
        args = jf.OperatorArgs().set_conv_forward(handles["C"], w)
        if side:
            args.set_side_input_add(handles["S"], **side)
        return plan.execute(x, args)

    with pytest.raises(ValueError, match="set_side_input_add"):
        execute()  # never set
    with pytest.raises(ValueError, match="z is missing"):
        execute(z=None)
    with pytest.raises(ValueError, match=r"set_side_input_add: z has shape \(1, 5, 6\), "
                                          "expected"):
        execute(z=jnp.ones(out_shape[:3], jnp.float16))
    with pytest.raises(TypeError, match="set_side_input_add: z has dtype float32, expected "
                                        "float16"):
        execute(z=jnp.ones(out_shape, jnp.float32))
    with pytest.raises(TypeError, match="SideInputAddOp"):
        jf.OperatorArgs().set_side_input_add(handles["A"], jnp.ones(out_shape, jnp.float16))
    with pytest.raises(jf.UnsupportedFusionError, match="already has a side-input add"):
        plan.add_side_input_add()


def test_side_input_is_a_pytree_leaf() -> None:
    plan, handles = _side_plan()
    z = jnp.ones(plan.output_desc.shape)
    args = jf.OperatorArgs().set_side_input_add(handles["S"], z, alpha=0.5)
    leaves = jax.tree_util.tree_leaves(args)
    assert any(leaf is z for leaf in leaves)
    assert any(isinstance(leaf, float) and leaf == 0.5 for leaf in leaves)
    rebuilt = jax.tree_util.tree_map(lambda v: v, args)
    assert rebuilt.entry(handles["S"]).arrays[0] is z


def test_side_input_is_memoized_like_any_operator() -> None:
    base = Case(ops="CNSA", n=1, c=3, h=5, w=5, k=4)
    for case in (base, dataclasses.replace(base)):
        plan, _ = case.build()
        plan.compile()
    info = jf.cache_info()
    assert info["hits"] >= 1
