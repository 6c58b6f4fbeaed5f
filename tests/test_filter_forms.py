"""Fused kernels that read the filters in another layout than the plan's (jaxfuse.solvers:
kernel_filters): fp32 NHWC plans with HWIO filters on Hopper run a kernel for OHWI filters,
each call transposing the filters first. Which plans take that form, that the form computes
the plan's result (values and derivatives), and that kernel_info says so."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, run_case

from jaxfuse import solvers
from jaxfuse.compiled import compile_signature
from jaxfuse.measure import TIMING_SCALARS, random_operands
from jaxfuse.reference import reference_float64

HOPPER = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
AMPERE = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
CPU = types.SimpleNamespace(platform="cpu")

# 2 x 32 x 32 output pixels (2048: the smallest problem that transposes its filters).
BIG = Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", n=2, c=32, h=32,
           w=32, k=64)


def _signature(case: Case):
    return case.build()[0].signature


@pytest.mark.parametrize("case, target, expected", [
    (BIG, HOPPER, "OHWI"),
    (BIG, AMPERE, None),  # measured on Hopper only
    (BIG, CPU, None),  # the host kernels read any layout as fast
    (dataclasses.replace(BIG, n=1), HOPPER, None),  # 1024 pixels: the transpose would not pay
    (dataclasses.replace(BIG, dtype="bfloat16"), HOPPER, None),  # 16-bit wgmma reads HWIO
    (dataclasses.replace(BIG, filter_layout="OHWI"), HOPPER, None),  # already K-major
    (dataclasses.replace(BIG, layout="NCHW", filter_layout="OIHW"), HOPPER, None),
    (dataclasses.replace(BIG, precision="highest"), HOPPER, None),  # no TF32 allowed
    (dataclasses.replace(BIG, c=3, r=7, s=7), HOPPER, None),  # the stem: no TF32 kernel
])
def test_which_plans_transpose_their_filters(case: Case, target, expected) -> None:
    assert solvers.kernel_filters(_signature(case), target) == expected


def test_no_transposed_form_when_tf32_kernels_are_off(monkeypatch) -> None:
    monkeypatch.setenv("JAXFUSE_TF32_KERNELS", "0")
    assert solvers.kernel_filters(_signature(BIG), HOPPER) is None


def _fused_calls(fn, *operands) -> list:
    """The fused-chain equations of `fn`'s jaxpr (nested ones included), and whether a
    transpose runs ahead of them."""
    found, transposes = [], []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "jaxfuse_fused_chain":
                found.append(eqn.params["signature"])
            if eqn.primitive.name == "transpose":
                transposes.append(eqn.params["permutation"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*operands).jaxpr)
    return found, transposes


@pytest.mark.parametrize("filters", [None, "OHWI"])
def test_the_form_runs_the_kernel_for_its_layout(filters) -> None:
    """Both paths (the find step's function, a compiled plan's execute) bind the primitive
    with the form's filter layout, the filters transposed ahead of it."""
    signature = _signature(BIG)
    operands = [*random_operands(signature, jax.devices("cpu")[0], 1)[0],
                jnp.asarray(TIMING_SCALARS)]
    plan = dataclasses.replace(compile_signature(signature, jax.devices("cpu")[0], "fused"),
                               filters=filters)
    for fn in (solvers.fused_function(signature, filters), plan.execute):
        found, transposes = _fused_calls(fn, *operands)
        assert [sig.conv.filter_layout for sig in found] == [filters or "HWIO"]
        assert transposes == ([(3, 0, 1, 2)] if filters else [])


@pytest.mark.parametrize("prepared, expected", [
    ("conv_tma", "OHWI"), ("conv_wgmma", "OHWI"),
    ("conv_direct", None),  # not a K-major tensor-core kernel: the plan's own form
    ("raise", None),  # the form failed to compile: the plan's own form
])
def test_prepare_keeps_the_form_only_for_the_kernels_it_is_for(monkeypatch, prepared,
                                                                expected) -> None:
    signature = _signature(BIG)
    seen = []

    def fake_prepare(sig, device):
        seen.append(sig.conv.filter_layout)
        if sig.conv.filter_layout == "OHWI" and prepared == "raise":
            raise solvers.FusionError("no kernel")
        return solvers.FusedKernel(prepared if sig.conv.filter_layout == "OHWI" else "conv_tma")

    monkeypatch.setattr(solvers, "kernel_filters", lambda sig, device: "OHWI")
    monkeypatch.setattr(solvers, "_prepare", fake_prepare)
    kernel = solvers.prepare_fused(signature, HOPPER)
    assert kernel.filters == expected
    assert seen == (["OHWI"] if expected else ["OHWI", "HWIO"])
    assert kernel.label.endswith(", OHWI filters") == (expected is not None)


def test_form_operands_transpose_only_the_filters() -> None:
    signature = _signature(BIG)
    rng = np.random.default_rng(0)
    operands = [rng.standard_normal(spec.shape).astype(spec.dtype)
                for spec in signature.operands]
    out = solvers.form_operands(signature, "OHWI", operands)
    target = solvers.with_filters(signature, "OHWI")
    assert [tuple(o.shape) for o in out] == [spec.shape for spec in target.operands]
    w = [spec.name for spec in signature.operands].index("w")
    np.testing.assert_array_equal(np.asarray(out[w]), operands[w].transpose(3, 0, 1, 2))
    for i, (a, b) in enumerate(zip(out, operands)):
        if i != w:
            assert a is b


def test_the_transposed_form_computes_the_plan_and_its_gradient() -> None:
    """On the host (the form's arithmetic is the OHWI plan's, which every backend runs): the
    form's results and filter gradients against the plan's own, both against float64."""
    signature = _signature(BIG)
    operands = [*random_operands(signature, jax.devices("cpu")[0], 1, seed=1)[0],
                jnp.asarray(TIMING_SCALARS)]
    own = jax.jit(solvers.fused_function(signature))
    transposed = jax.jit(solvers.fused_function(signature, "OHWI"))
    ref = reference_float64(signature, *operands)
    for run in (own, transposed):
        out = np.asarray(run(*operands), np.float64)
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5

    # A plan compiled in that form (as prepare_fused makes it on Hopper), differentiated.
    cpu = jax.devices("cpu")[0]
    forms = [dataclasses.replace(compile_signature(signature, cpu, "fused"), filters=filters)
             for filters in (None, "OHWI")]

    def loss(plan, w):
        ops = list(operands)
        ops[1] = w
        return jnp.sum(jax.nn.sigmoid(plan.execute(*ops)))

    for plan in forms:  # the form's forward too, through the plan's path
        out = np.asarray(jax.jit(plan.execute)(*operands), np.float64)
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    g_own, g_transposed = (jax.grad(functools.partial(loss, plan))(operands[1])
                           for plan in forms)
    assert g_transposed.shape == operands[1].shape
    np.testing.assert_allclose(np.asarray(g_transposed), np.asarray(g_own), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_on_hopper_big_fp32_plans_run_on_transposed_filters(device) -> None:
    if device is None or device.platform != "gpu":
        pytest.skip("needs a GPU")
    err = run_case(BIG, device, solver="fused")
    plan, _ = BIG.build()
    plan.compile(device, solver="fused")
    info = plan.kernel_info
    if str(getattr(device, "compute_capability", "")) == "9.0":
        assert info.get("filters", "").startswith("OHWI"), info
        assert info["solver"] in ("conv_tma", "conv_wgmma"), info
    else:
        assert "filters" not in info, info
    assert err < BIG.tolerance(device)
