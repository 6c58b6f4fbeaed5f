"""The fused primitive and its FFI handlers trust nothing from Python: binding the primitive
with operands that contradict its signature, calling the custom call target directly with
mismatched buffers, hand-edited or fuzzed plan strings, and exported programs whose plan was
edited all raise a Python exception naming the problem; none crashes the process."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, edited_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxfuse as jf
from jaxfuse._extension import FFI_TARGET, extension
from jaxfuse.activations import ActivationMode
from jaxfuse.primitive import fused_chain_p

CASE = Case(ops="CBNSA", n=2, c=4, h=5, w=6, k=6)


def _operands(signature: jf.PlanSignature, device: Any) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    return [jax.device_put(jnp.asarray(rng.standard_normal(spec.shape), spec.dtype), device)
            for spec in signature.operands]


def _ffi_call(result: Any, operands: list[Any], **attributes: Any) -> Any:
    """The custom call target, bypassing the primitive and all of its Python checks. Blocks:
    on a GPU a handler's error surfaces when the result is awaited."""
    return jax.block_until_ready(
        jax.jit(lambda *ops: jax.ffi.ffi_call(FFI_TARGET, result)(*ops, **attributes))(*operands))


@pytest.fixture(scope="module")
def compiled() -> jf.PlanSignature:
    plan, _ = CASE.build()
    return plan.signature


# ----- binding the primitive directly -----------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True])
def test_direct_bind_checks_operands_against_the_signature(compiled, jit) -> None:
    sig = compiled
    ops = _operands(sig, jax.devices("cpu")[0])
    bind = (jax.jit(lambda *o: fused_chain_p.bind(*o, signature=sig)) if jit else
            lambda *o: fused_chain_p.bind(*o, signature=sig))
    assert bind(*ops).shape == sig.output_shape
    with pytest.raises(TypeError, match="takes 9 operands"):
        bind(*ops[:-1])
    with pytest.raises(ValueError, match=r"w has shape \(6, 4, 3, 4\), expected \(6, 4, 3, 3\)"):
        bind(ops[0], jnp.ones((6, 4, 3, 4)), *ops[2:])
    with pytest.raises(ValueError, match="x has shape"):
        bind(ops[0].reshape(2, 4, 6, 5), *ops[1:])  # same element count, other shape
    with pytest.raises(TypeError, match="bias has dtype float16, expected float32"):
        bind(*ops[:2], ops[2].astype(jnp.float16), *ops[3:])
    with pytest.raises(TypeError, match="side has dtype bfloat16"):
        bind(*ops[:7], ops[7].astype(jnp.bfloat16), ops[8])
    with pytest.raises(TypeError, match="needs a PlanSignature"):
        fused_chain_p.bind(*ops, signature=sig.encode())


# ----- calling the FFI target with buffers that do not match the plan ---------------------------

def _mismatches(sig: jf.PlanSignature, ops: list[Any]) -> list[tuple[str, Any, list, str]]:
    """(name, result type, operands, expected message) for each way to contradict the plan."""
    out = jax.ShapeDtypeStruct(sig.output_shape, sig.dtype)
    names = [spec.name for spec in sig.operands]
    cases = [
        ("one operand short", out, ops[:-1], "takes 9 operands, got 8"),
        ("one operand extra", out, [*ops, ops[-1]], "takes 9 operands, got 10"),
        ("output one element short", jax.ShapeDtypeStruct((2, 6, 5, 5), sig.dtype), ops,
         "output buffer does not match"),
        ("output dtype", jax.ShapeDtypeStruct(sig.output_shape, jnp.float16), ops,
         "output buffer does not match"),
    ]
    for i, name in enumerate(names):
        grown = jnp.concatenate([ops[i].reshape(-1), ops[i].reshape(-1)[:1]])
        cases.append((f"{name} one element more", out, [*ops[:i], grown, *ops[i + 1:]],
                      f"{name} has {grown.size} elements, expected {ops[i].size}"))
        other = jnp.float16 if ops[i].dtype == jnp.float32 else jnp.float32
        cases.append((f"{name} dtype", out, [*ops[:i], ops[i].astype(other), *ops[i + 1:]],
                      f"{name} has the wrong dtype"))
    cases.append(("x as int32", out, [ops[0].astype(jnp.int32), *ops[1:]],
                  "x has the wrong dtype"))
    return cases


def test_ffi_handler_checks_every_buffer(compiled, device) -> None:
    sig = compiled
    ops = _operands(sig, device)
    out = jax.ShapeDtypeStruct(sig.output_shape, sig.dtype)
    good = _ffi_call(out, ops, plan=sig.encode())
    assert good.shape == sig.output_shape
    for _, result, operands, message in _mismatches(sig, ops):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            _ffi_call(result, operands, plan=sig.encode())


@pytest.mark.parametrize("attributes, message", [
    ({}, "attributes"),
    ({"plan": 5}, "attribute"),
    ({"plan": np.int64(7)}, "attribute"),
    ({"plan": "x", "other": 1}, "attributes"),
    ({"plan": "x", "uses_pdl": 1}, "'uses_pdl' must be a bool"),
])
def test_ffi_handler_checks_its_attributes(compiled, attributes, message, device) -> None:
    sig = compiled
    out = jax.ShapeDtypeStruct(sig.output_shape, sig.dtype)
    with pytest.raises(RuntimeError, match=message):
        _ffi_call(out, _operands(sig, device), **attributes)


def _lies(plan: str) -> list[tuple[str, str]]:
    """Hand edits of a valid plan string and what the handler must say about each."""
    edit = plan.replace
    return [
        (edit("in=2,4,5,6", "in=2,4,5,7"), "x has 240 elements, expected 280"),
        (edit("in=2,4,5,6", "in=4,4,5,6"), "x has 240 elements, expected 480"),
        (edit("conv=6,3,3", "conv=6,3,5"), "w has 216 elements, expected 360"),
        (edit("conv=6,", "conv=12,"), "w has 216 elements, expected 432"),
        (edit(",1,1,1,1,1,1,1,OIHW", ",9,9,1,1,1,1,1,OIHW"), "side has"),  # padding 9
        (edit("in=2,4,5,6", "in=2,4,5,2147483648"), "outside [1, 2147483647]"),
        (edit("in=2,4,5,6", "in=2,4,5,-6"), "outside [1, 2147483647]"),
        (edit("in=2,4,5,6", "in=2,4,5,99999999999999999999999"), "outside"),
        (edit("in=2,4,5,6", "in=2000000000,4,50000,60000"), "too many elements"),
        (edit("conv=6,3,3,1,1,1,1,1,1", "conv=6,3,3,1,1,1073741824,1073741824,1,1"),
         "padded input is larger than 2^31 - 1"),
        (edit("ops=CBNSA", "ops=CBNSAC"), "repeats"),
        (edit("ops=CBNSA", "ops=BCNSA"), "first operator"),
        (edit("ops=CBNSA", "ops=CBXSA"), "unknown operator"),
        (edit("ops=CBNSA", "ops="), "'ops' is empty"),
        (edit(";bn=spatial", ""), "batchnorm needs bn="),
        # The C++ enum (kernels/epilogue.h) has exactly jaxfuse.ActivationMode's modes.
        (edit("act=3", f"act={len(ActivationMode)}"), f"outside [0, {len(ActivationMode) - 1}]"),
        (edit("act=3", "act=3;act2=1"), "unknown field 'act2'"),
        (edit("dtype=f32", "dtype=f64"), "unknown dtype"),
        (edit("jaxfuse1", "jaxfuse2"), "version tag"),
        (edit(",OIHW,", ",XXXX,"), "unknown filter layout"),
        (edit(",OIHW,1", ",OIHW"), "14 entries"),
        (plan + ";", "has no '='"),
        (plan[: len(plan) // 2], "invalid jaxfuse plan"),
        ("", "version tag"),
        ("jaxfuse1;dtype=f32;layout=NCHW;in=1,1,1,1;ops=A;act=3\x00garbage",
         "'act' has a character outside the plan grammar (\\x00 at offset 5)"),
        (edit("act=3", "act=\n#error X\n;act=3"), "'act' has a character outside the plan"),
        (edit("ops=CBNSA", "ops=CBNSA;ops=CBNSA"), "field 'ops' is repeated"),
    ]


def test_lying_and_malformed_plans_are_refused(compiled, device) -> None:
    sig = compiled
    ops = _operands(sig, device)
    out = jax.ShapeDtypeStruct(sig.output_shape, sig.dtype)
    for plan, message in _lies(sig.encode()):
        assert plan != sig.encode()
        with pytest.raises(RuntimeError, match=re.escape(message)):
            _ffi_call(out, ops, plan=plan)


# ----- fuzzed plan strings ----------------------------------------------------------------------

@st.composite
def _mutated(draw: Any, plan: str) -> str:
    """`plan` after one to three random edits (:func:`cases.edited_plan`)."""
    return edited_plan(draw, plan, (1, 3))


def test_fuzzed_plan_strings_never_crash(compiled, device) -> None:
    sig = compiled
    ext = extension()
    ops = _operands(sig, device)
    out = jax.ShapeDtypeStruct(sig.output_shape, sig.dtype)
    examples = 80 if device.platform == "cpu" else 15

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_mutated(sig.encode()))
    def run(plan: str) -> None:
        try:
            ext.cpu_prepare(plan)
        except ValueError as err:
            assert "jaxfuse" in str(err)
        try:
            result = _ffi_call(out, ops, plan=plan)
        except RuntimeError as err:  # the handler's error (or, on a GPU, the compiler's)
            assert str(err)
        else:  # the edit kept every size: a plan of the same shapes ran
            assert result.shape == sig.output_shape

    run()


# ----- exported programs whose plan was edited after serialization ------------------------------

def _exported_bytes(sig: jf.PlanSignature, device: Any) -> tuple[bytes, list[Any]]:
    plan, handles = CASE.build()
    plan.compile(device)

    def layer(x, w, b, scale, shift, mean, var, z):
        args = (jf.OperatorArgs().set_conv_forward(handles["C"], w)
                .set_bias_forward(handles["B"], b)
                .set_batchnorm_inference(handles["N"], scale, shift, mean, var)
                .set_side_input_add(handles["S"], z)
                .set_activation_forward(handles["A"]))
        return plan.execute(x, args)

    ops = _operands(sig, device)[:-1]
    platform = "cuda" if device.platform == "gpu" else device.platform
    exported = jax.export.export(jax.jit(layer), platforms=(platform,),
                                 disabled_checks=jf.export_disabled_checks())(*ops)
    return bytes(exported.serialize()), ops


def test_exported_program_with_an_edited_plan(compiled, device) -> None:
    sig = compiled
    blob, ops = _exported_bytes(sig, device)
    plan = sig.encode()
    assert blob.count(plan.encode()) == 1
    good = jax.export.deserialize(bytearray(blob)).call(*ops)
    assert good.shape == sig.output_shape
    # Edits that keep the string's length (the serialized module stays well-formed).
    for old, new, message in [("in=2,4,5,6", "in=2,4,5,7", "x has 240 elements, expected 280"),
                              ("conv=6,3,3", "conv=6,3,5", "w has 216 elements"),
                              ("ops=CBNSA", "ops=CBXSA", "unknown operator 'X'"),
                              ("dtype=f32", "dtype=f64", "unknown dtype")]:
        edited = blob.replace(plan.encode(), plan.replace(old, new).encode())
        with pytest.raises(RuntimeError, match=re.escape(message)):
            jax.block_until_ready(jax.export.deserialize(bytearray(edited)).call(*ops))
