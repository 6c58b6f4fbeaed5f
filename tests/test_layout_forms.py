"""Fused kernels that read the input in another layout than the plan's (jaxfuse.solvers:
kernel_forms): NCHW plans on Hopper may run a kernel that reads their input transposed to
NHWC, with HWIO filters (fp32 through TF32: K-major ones), and writes NCHW itself
(signature.output_layout). Which plans get that form, that the signature of mixed layouts
travels to C++ and back, that the form computes the plan's result, that the find step keeps
the faster form (and remembers it), and that the host backend refuses the form with a
reason."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case

from jaxfuse import compiled, find, solvers
from jaxfuse._extension import extension
from jaxfuse.measure import TIMING_SCALARS, Timing, random_operands
from jaxfuse.reference import reference_float64, unfused

HOPPER = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="H100")
AMPERE = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
CPU = types.SimpleNamespace(platform="cpu")

# 2 x 32 x 32 output pixels: the smallest problem offered the NHWC form.
BIG = Case(ops="CBNSA", dtype="float16", layout="NCHW", filter_layout="OIHW", n=2, c=64, h=32,
           w=32, k=24, bn_mode="per_activation")


@pytest.fixture(autouse=True)
def _default_forms(monkeypatch) -> None:
    """Each test starts from the forms' defaults, whatever the run's variables say (the GPU
    queue runs items with them set)."""
    for variable in ("JAXFUSE_NHWC_FORM", "JAXFUSE_TF32_NCHW_FORM", "JAXFUSE_TF32_KERNELS"):
        monkeypatch.delenv(variable, raising=False)


def _signature(case: Case):
    return case.build()[0].signature


def _operands(signature, seed: int = 0) -> list:
    return [*random_operands(signature, jax.devices("cpu")[0], 1, seed=seed)[0],
            jnp.asarray(TIMING_SCALARS)]


@pytest.mark.parametrize("case, target, offered", [
    (BIG, HOPPER, True),
    (dataclasses.replace(BIG, dtype="bfloat16", filter_layout="OHWI"), HOPPER, True),
    (BIG, AMPERE, False),  # the kernels that write NCHW from NHWC input are Hopper's
    (BIG, CPU, False),
    (dataclasses.replace(BIG, n=1), HOPPER, False),  # 1024 pixels
    (dataclasses.replace(BIG, dtype="float32"), HOPPER, True),  # (TF32: K-major filters)
    (dataclasses.replace(BIG, layout="NHWC", filter_layout="HWIO"), HOPPER, False),
    (dataclasses.replace(BIG, ops="BNA", k=None), HOPPER, False),  # no convolution
])
def test_which_plans_get_the_nhwc_form(monkeypatch, case: Case, target, offered: bool) -> None:
    forms = solvers.kernel_forms(_signature(case), target)
    filters = "OHWI" if case.dtype == "float32" else "HWIO"
    assert forms == ([(filters, "NHWC")] if offered else [])


@pytest.mark.parametrize("case, form", [
    (dataclasses.replace(BIG, dtype="float32"), [("OHWI", "NHWC")]),  # K-major for TF32
    (dataclasses.replace(BIG, dtype="float32", r=1, s=1, padding="VALID"), [("OIHW", "NHWC")]),
    (dataclasses.replace(BIG, dtype="float32", precision="highest"), []),  # no TF32
    (dataclasses.replace(BIG, dtype="float32", c=48, k=48), []),  # 32-channel k-tiles
    (dataclasses.replace(BIG, dtype="float32", n=1), [("OHWI", "NHWC")]),  # at any size
])
def test_fp32_plans_get_the_tf32_form_unless_switched_off(monkeypatch, case: Case, form) -> None:
    assert solvers.kernel_forms(_signature(case), HOPPER) == form
    assert solvers.kernel_forms(_signature(case), AMPERE) == []
    monkeypatch.setenv("JAXFUSE_TF32_NCHW_FORM", "0")
    assert solvers.kernel_forms(_signature(case), HOPPER) == []
    monkeypatch.setenv("JAXFUSE_TF32_NCHW_FORM", "1")
    monkeypatch.setenv("JAXFUSE_TF32_KERNELS", "0")
    assert solvers.kernel_forms(_signature(case), HOPPER) == []


def test_only_16_bit_plans_need_enough_pixels_for_the_form() -> None:
    """Batch 1 of a 32x32 layer is 1024 output pixels: the fp32 form (split-K TF32 kernels
    there) is offered, the 16-bit one is not."""
    assert solvers.kernel_forms(_signature(dataclasses.replace(BIG, dtype="float32", n=1)),
                                HOPPER) == [("OHWI", "NHWC")]
    assert solvers.kernel_forms(_signature(dataclasses.replace(BIG, n=1)), HOPPER) == []


def test_a_1x1_tf32_form_reads_the_plan_s_own_filters(monkeypatch) -> None:
    """OIHW filters of one tap are K-major already: the form transposes the input alone."""
    monkeypatch.setenv("JAXFUSE_TF32_NCHW_FORM", "1")
    monkeypatch.setattr(solvers, "_prepare", lambda sig, device: solvers.FusedKernel(
        "conv_tma" if sig.layout == "NHWC" else "conv_igemm"))
    for case, filters in [(dataclasses.replace(BIG, dtype="float32", r=1, s=1,
                                               padding="VALID"), None),
                          (dataclasses.replace(BIG, dtype="float32"), "OHWI")]:
        kernels = solvers.prepare_forms(_signature(case), HOPPER)
        assert [(k.solver, k.input_layout, k.filters) for k in kernels] == \
            [("conv_igemm", None, None), ("conv_tma", "NHWC", filters)]


def test_no_nhwc_form_when_switched_off(monkeypatch) -> None:
    monkeypatch.setenv("JAXFUSE_NHWC_FORM", "0")
    assert solvers.kernel_forms(_signature(BIG), HOPPER) == []


def test_the_form_signature_has_mixed_layouts() -> None:
    signature = _signature(BIG)
    form = solvers.kernel_signature(signature, "HWIO", "NHWC")
    assert (form.layout, form.out_layout, form.conv.filter_layout) == ("NHWC", "NCHW", "HWIO")
    assert form.input_shape == (2, 32, 32, 64)
    assert form.output_shape == signature.output_shape == (2, 24, 32, 32)
    assert [s.shape for s in form.operands if s.name in ("side", "scale")] == \
        [s.shape for s in signature.operands if s.name in ("side", "scale")]
    assert "NHWC>NCHW" in form.describe()
    # C++ parses it and gives back the same canonical form; the plan's own form has no olayout.
    encoded = form.encode()
    assert ";olayout=NCHW;" in encoded
    assert extension().plan_canonical(encoded) == encoded
    assert "olayout" not in signature.encode()
    assert solvers.kernel_signature(signature) == signature


@pytest.mark.parametrize("text, message", [
    ("jaxfuse1;dtype=f16;layout=NHWC;olayout=NCHW;in=1,8,4,4;ops=BA;act=3", "no convolution"),
    ("jaxfuse1;dtype=f16;layout=NHWC;olayout=NCWH;in=1,8,4,4;ops=BA;act=3", "unknown olayout"),
])
def test_bad_output_layouts_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        extension().plan_canonical(text)


def test_the_host_backend_refuses_the_form() -> None:
    encoded = solvers.kernel_signature(_signature(BIG), "HWIO", "NHWC").encode()
    with pytest.raises(ValueError, match="GPU kernel form"):
        extension().cpu_prepare(encoded)
    with pytest.raises(solvers.FusionError, match="GPU kernel form"):
        solvers.prepare_fused(solvers.kernel_signature(_signature(BIG), "HWIO", "NHWC"),
                              jax.devices("cpu")[0])


def test_the_form_computes_the_plan() -> None:
    """The references and XLA's composition of the form's signature, on the transposed
    operands, against the plan's own (float64; and the float32 unfused chain, which is what
    the form's derivative runs)."""
    signature = dataclasses.replace(_signature(BIG), dtype=np.dtype(np.float32))
    form = solvers.kernel_signature(signature, "HWIO", "NHWC")
    operands = _operands(signature, seed=3)
    moved = solvers.form_operands(signature, "HWIO", operands, "NHWC")
    assert [tuple(o.shape) for o in moved] == [s.shape for s in form.operands]
    ref = reference_float64(signature, *operands)
    np.testing.assert_allclose(reference_float64(form, *moved), ref, rtol=1e-10, atol=1e-10)
    for fn in (lambda sig, ops: unfused(sig, *ops),
               lambda sig, ops: solvers.xla_function(sig)(*ops)):
        np.testing.assert_allclose(np.asarray(fn(form, moved), np.float64),
                                   np.asarray(fn(signature, operands), np.float64),
                                   rtol=2e-4, atol=2e-4)
    # The function the find step times transposes ahead of one primitive of the form.
    calls = jax.make_jaxpr(solvers.fused_function(signature, "HWIO", "NHWC"))(*operands)
    bound = [e.params["signature"] for e in calls.jaxpr.eqns
             if e.primitive.name == "jaxfuse_fused_chain"]
    permutations = [e.params["permutation"] for e in calls.jaxpr.eqns
                    if e.primitive.name == "transpose"]
    assert bound == [form] and sorted(permutations) == [(0, 2, 3, 1), (2, 3, 1, 0)]


def test_prepare_forms_keeps_the_forms_that_compile_to_their_kernels(monkeypatch) -> None:
    signature = _signature(BIG)
    made = {"NCHW": "conv_wgmma", "NHWC": "conv_tma"}

    def fake_prepare(sig, device):
        return solvers.FusedKernel(made[sig.layout])

    monkeypatch.setattr(solvers, "_prepare", fake_prepare)
    kernels = solvers.prepare_forms(signature, HOPPER)
    assert [(k.solver, k.input_layout, k.filters) for k in kernels] == \
        [("conv_wgmma", None, None), ("conv_tma", "NHWC", "HWIO")]
    assert kernels[1].label == "conv_tma, NHWC input, HWIO filters"
    made["NHWC"] = "conv_direct"  # not a kernel the form is for
    assert len(solvers.prepare_forms(signature, HOPPER)) == 1

    def failing(sig, device):
        if sig.layout == "NHWC":
            raise solvers.FusionError("no kernel")
        return solvers.FusedKernel("conv_wgmma")

    monkeypatch.setattr(solvers, "_prepare", failing)
    assert len(solvers.prepare_forms(signature, HOPPER)) == 1


def test_the_faster_form_is_kept_and_remembered(monkeypatch) -> None:
    signature = _signature(BIG)
    kernels = [solvers.FusedKernel("conv_wgmma", (("tile", "t"),)),
               solvers.FusedKernel("conv_tma", (("tile", "u"),), filters="HWIO",
                                     input_layout="NHWC")]
    timed = []

    def fake_time(sig, device, forms, trial=None):
        timed.append(len(forms))
        return {forms[0].label: 20.0, forms[1].label: 12.5}

    monkeypatch.setattr(find, "_time_forms", fake_time)
    stored: dict[str, bytes] = {}
    fake_ext = types.SimpleNamespace(cache_load=stored.get,
                                     cache_store=stored.__setitem__,
                                     kernel_sources=extension().kernel_sources,
                                     cpu_threads=extension().cpu_threads)
    monkeypatch.setattr(find, "extension", lambda: fake_ext)
    assert find.fastest_form(signature, HOPPER, kernels) is kernels[1]
    assert find.fastest_form(signature, HOPPER, kernels) is kernels[1]
    assert timed == [2] and len(stored) == 1  # the second answer came from the cache
    # A form that failed to run is not remembered: measured again next time.
    stored.clear()
    monkeypatch.setattr(find, "_time_forms",
                        lambda sig, device, forms, trial: {forms[0].label: 9.0})
    assert find.fastest_form(signature, HOPPER, kernels) is kernels[0]
    assert not stored
    monkeypatch.setattr(find, "_time_forms", lambda sig, device, forms, trial: {})
    assert find.fastest_form(signature, HOPPER, kernels) is kernels[0]


def test_vmap_of_the_form_folds_into_its_output_layout() -> None:
    """The batching rule on a form signature (input NHWC, output NCHW), the unfused chain
    standing in for the kernel: vmapped filters fold into channel groups and the result is
    split at the output's channel axis; the same for vmapped inputs (batch) and scalars."""
    from jaxfuse.reference import unfused
    from jaxfuse.transforms.batching import batching_rule

    signature = dataclasses.replace(_signature(BIG), dtype=np.dtype(np.float32))
    form = solvers.kernel_signature(signature, "HWIO", "NHWC")
    rule = batching_rule(lambda sig, *ops: unfused(sig, *ops))
    examples = [solvers.form_operands(signature, "HWIO", _operands(signature, seed=s), "NHWC")
                for s in range(3)]
    names = [spec.name for spec in form.operands]
    for batched in ({"w", "bias", "scale"}, {"x", "side"}, {"w", "scalars"}):
        args = [jnp.stack([e[i] for e in examples]) if n in batched else examples[0][i]
                for i, n in enumerate(names)]
        dims = [0 if n in batched else None for n in names]
        out, axis = rule(args, dims, signature=form)
        assert axis == 0 and out.shape == (3, *form.output_shape)
        for b in range(3):
            ops = [examples[b][i] if n in batched else examples[0][i]
                   for i, n in enumerate(names)]
            np.testing.assert_allclose(np.asarray(out[b]), np.asarray(unfused(form, *ops)),
                                       rtol=2e-4, atol=2e-4)


def test_a_signature_has_one_spelling() -> None:
    signature = _signature(BIG)
    same = dataclasses.replace(signature, output_layout=signature.layout)
    assert same.output_layout is None and same == signature and hash(same) == hash(signature)
    with pytest.raises(ValueError, match="output_layout"):
        dataclasses.replace(signature, output_layout="NWHC")


def test_forms_are_offered_only_where_a_kernel_writes_them() -> None:
    # (64-channel groups for the Hopper kernels, few channels for the stem kernel)
    for case, offered in [(dataclasses.replace(BIG, c=64, k=64), True),
                          (dataclasses.replace(BIG, c=3, k=64, r=7, s=7, h=64, w=64), True),
                          (dataclasses.replace(BIG, c=96, k=96), False),
                          (dataclasses.replace(BIG, c=128, k=128, groups=128), False)]:
        assert bool(solvers.kernel_forms(_signature(case), HOPPER)) == offered, case


def test_a_form_that_disagrees_is_not_kept(monkeypatch) -> None:
    """fastest_form's timing drops a form whose result differs from the plan's own form."""
    signature = dataclasses.replace(_signature(dataclasses.replace(BIG, c=64, k=64)),
                                    dtype=np.dtype(np.float32))
    kernels = [solvers.FusedKernel("own"), solvers.FusedKernel("form", input_layout="NHWC")]
    outputs = {None: jnp.ones((2, 3)), "NHWC": jnp.full((2, 3), 2.0)}

    class FakeHarness:
        def __init__(self, layout):
            self.layout = layout

        def run(self):
            return outputs[self.layout], types.SimpleNamespace(cost=1e-6)

    monkeypatch.setattr(find.Harness, "compile",
                        staticmethod(lambda fn, sets, device, **kw: FakeHarness(fn.layout)))
    monkeypatch.setattr(find, "fused_function",
                        lambda sig, filters, layout: types.SimpleNamespace(layout=layout))
    monkeypatch.setattr(find, "random_operands", lambda *args: [])
    monkeypatch.setattr(find, "set_count", lambda *args: 1)
    cpu = jax.devices("cpu")[0]
    assert find._time_forms(signature, cpu, kernels) == {"own": 1.0}
    outputs["NHWC"] = jnp.ones((2, 3))
    assert find._time_forms(signature, cpu, kernels) == {"own": 1.0, "form, NHWC input": 1.0}


def test_a_plan_of_several_forms_reports_their_timing_as_a_step(monkeypatch) -> None:
    """compile_s keeps the forms' timing apart from the kernel step, so that a cold sweep
    shows the selection issue #11 bounds (forms, then the choice) on its own."""
    own, form = solvers.FusedKernel("conv_igemm"), solvers.FusedKernel("conv_tma")
    form = dataclasses.replace(form, input_layout="NHWC")
    monkeypatch.setattr(compiled, "prepare_forms", lambda signature, device: [own, form])
    monkeypatch.setattr(compiled.find, "fastest_form",
                        lambda signature, device, kernels, trial=None: kernels[1])
    plan = compiled._compile(_signature(BIG), "cpu", jax.devices("cpu")[0], "fused")
    assert plan.kernel == "conv_tma" and plan.input_layout == "NHWC"
    assert [step for step, _ in plan.seconds] == ["kernel", "forms"]
    monkeypatch.setattr(compiled, "prepare_forms", lambda signature, device: [own])
    plan = compiled._compile(_signature(BIG), "cpu", jax.devices("cpu")[0], "fused")
    assert [step for step, _ in plan.seconds] == ["kernel"]


def test_the_choice_measures_with_the_sets_and_harness_the_forms_left(monkeypatch) -> None:
    """A plan of several forms draws its random input sets once and compiles the chosen form's
    timing program once: the choice against XLA takes both from the forms' timing (a set is
    hundreds of megabytes at batch 256)."""
    signature = dataclasses.replace(_signature(dataclasses.replace(BIG, c=64, k=64)),
                                    dtype=np.dtype(np.float32))
    kernels = [solvers.FusedKernel("own"), solvers.FusedKernel("form", input_layout="NHWC")]
    drawn, compiled_for = [], []

    class FakeHarness:
        def __init__(self, tag):
            self.tag = tag

        def run(self, limit=None, warm_up=0.0):
            return jnp.ones((2, 3)), Timing({"NHWC": 1e-6, None: 2e-6}.get(self.tag, 3e-6))

    def fake_compile(fn, sets, device, sequential=False):
        compiled_for.append(fn.tag)
        return FakeHarness(fn.tag)

    monkeypatch.setattr(find.Harness, "compile", staticmethod(fake_compile))
    monkeypatch.setattr(find, "fused_function",
                        lambda sig, filters, layout: types.SimpleNamespace(tag=layout))
    monkeypatch.setattr(find, "xla_function", lambda sig: types.SimpleNamespace(tag="xla"))
    monkeypatch.setattr(find, "random_operands", lambda *args: drawn.append(args) or [()])
    cpu = jax.devices("cpu")[0]
    trial = find.Trial()
    assert find._time_forms(signature, cpu, kernels, trial) == {"own": 2.0,
                                                                "form, NHWC input": 1.0}
    decision = find._measure(signature, cpu, kernels[1], trial)
    assert decision.solver == "fused" and dict(decision.times_us) == pytest.approx(
        {"xla": 3.0, "fused": 1.0})
    assert len(drawn) == 1 and compiled_for == [None, "NHWC", "xla"]
