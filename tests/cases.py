"""Test cases shared by the CPU and GPU suites: one fusion plan, random operands, and the
float64 reference. Tolerances live here, stated once."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse as jf
from jaxfuse.activations import DEFAULT_PARAMS, ActivationMode
from jaxfuse.reference import reference_float64
from jaxfuse.signature import SCALARS

# Relative L2 error ||out - ref|| / ||ref|| allowed per dtype (fp32 leaves room for TF32 on
# GPUs; fp16/bf16 for one rounding of the output plus rounded inputs).
TOLERANCE = {np.dtype(jnp.float32): 2e-3, np.dtype(jnp.float16): 4e-3,
             np.dtype(jnp.bfloat16): 2.5e-2}
# The same with exact fp32 (precision="highest"; and always on CPU).
TOLERANCE_EXACT_FP32 = 1e-5
# Per element, |out - ref| <= tol * |ref| + tiny(dtype), for an activation applied to exact
# inputs (tests/test_activations.py). fp32: float32 rounding inside the formula, amplified in
# the tails (gelu's y ~ exp(-x^2 / 2): relative error r of x^2 / 2 becomes ~x^2 r / 2 in y;
# gelu_tanh's ~2|u| r). fp16/bf16: the output's rounding (the reference is rounded too).
ELEMENT_TOLERANCE = {np.dtype(jnp.float32): 1e-4, np.dtype(jnp.float16): 2.0**-10,
                     np.dtype(jnp.bfloat16): 2.0**-7}

FILTER_SHAPES = {"OIHW": lambda k, c, r, s: (k, c, r, s), "HWIO": lambda k, c, r, s: (r, s, c, k),
                 "OHWI": lambda k, c, r, s: (k, r, s, c)}

# Activation parameters that exercise each mode's formula away from its defaults.
ACT_PARAMS = {
    ActivationMode.TANH: (0.8, 1.3, 0.0),
    ActivationMode.POWER: (0.5, 0.7, 1.7),
    ActivationMode.CLIPPED_RELU: (0.9, 0.0, 0.0),
    ActivationMode.LEAKY_RELU: (0.2, 0.0, 0.0),
    ActivationMode.ELU: (0.6, 0.0, 0.0),
}


@dataclasses.dataclass(frozen=True)
class Case:
    ops: str = "CBNA"
    dtype: str = "float32"
    layout: str = "NCHW"
    filter_layout: str = "OIHW"
    n: int = 2
    c: int = 8
    h: int = 9
    w: int = 10
    k: int = 12
    r: int = 3
    s: int = 3
    strides: tuple[int, int] = (1, 1)
    padding: Any = ((1, 1), (1, 1))
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bn_mode: str = "spatial"
    activation: str = "relu"
    precision: str | None = None
    filter_dtype: str | None = None  # float32 filters of a 16-bit plan; None: the plan's dtype

    def __str__(self) -> str:
        wide = f"-w{self.filter_dtype}" if self.filter_dtype else ""
        return (f"{self.ops}-{self.dtype}-{self.layout}-{self.filter_layout}{wide}-"
                f"{self.n}x{self.c}x{self.h}x{self.w}-k{self.k}-{self.r}x{self.s}-"
                f"s{self.strides}-p{self.padding}-d{self.dilation}-g{self.groups}-"
                f"{self.bn_mode}-{self.activation}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        n, c, h, w = self.n, self.c, self.h, self.w
        return (n, c, h, w) if self.layout == "NCHW" else (n, h, w, c)

    @property
    def filter_shape(self) -> tuple[int, ...]:
        return FILTER_SHAPES[self.filter_layout](self.k, self.c // self.groups, self.r, self.s)

    def build(self) -> tuple[jf.FusionPlan, dict[str, Any]]:
        plan = jf.FusionPlan(jf.TensorDesc(self.input_shape, self.dtype, self.layout))
        handles: dict[str, Any] = {}
        for letter in self.ops:
            if letter == "C":
                conv = jf.ConvDesc(self.strides, self.padding, self.dilation, self.groups,
                                   self.precision)
                handles["C"] = plan.add_conv_forward(
                    conv, jf.TensorDesc(self.filter_shape, self.filter_dtype or self.dtype,
                                        self.filter_layout))
            elif letter == "B":
                channels = self.k if "C" in self.ops else self.c
                handles["B"] = plan.add_bias_forward(jf.TensorDesc((channels,), self.dtype))
            elif letter == "N":
                handles["N"] = plan.add_batchnorm_inference(self.bn_mode)
            elif letter == "S":
                handles["S"] = plan.add_side_input_add()
            elif letter == "A":
                handles["A"] = plan.add_activation_forward(self.activation)
        return plan, handles

    def random_args(self, plan: jf.FusionPlan, handles: dict[str, Any],
                    rng: np.random.Generator) -> tuple[Any, jf.OperatorArgs, list[np.ndarray]]:
        """Random x and arguments (never zeros), and the operands in float64 for the reference."""
        sig = plan.signature
        dtype = jnp.dtype(self.dtype)
        fan_in = (self.c // self.groups) * self.r * self.s if "C" in self.ops else 1
        x = jnp.asarray(rng.standard_normal(self.input_shape), dtype)
        args = jf.OperatorArgs()
        scalars = dict.fromkeys(SCALARS, 0.0)
        scalars.update(conv_alpha=1.0, side_alpha=1.0)
        operands: list[np.ndarray] = [np.asarray(x, np.float64)]
        for letter in self.ops:
            op = handles[letter]
            if letter == "C":
                w = jnp.asarray(rng.standard_normal(self.filter_shape) / np.sqrt(fan_in),
                                self.filter_dtype or dtype)
                alpha = 1.25
                args.set_conv_forward(op, w, alpha=alpha)
                scalars["conv_alpha"] = alpha
                operands.append(np.asarray(w, np.float64))
            elif letter == "B":
                b = rng.standard_normal(sig.param_shape["bias"]).astype(np.float32)
                args.set_bias_forward(op, b)
                operands.append(b.astype(np.float64))
            elif letter == "N":
                shape = sig.param_shape["batchnorm"]
                scale = rng.uniform(0.5, 1.5, shape).astype(np.float32)
                shift = rng.standard_normal(shape).astype(np.float32)
                mean = (0.3 * rng.standard_normal(shape)).astype(np.float32)
                var = rng.uniform(0.5, 2.0, shape).astype(np.float32)
                args.set_batchnorm_inference(op, scale, shift, mean, var, epsilon=1e-3)
                scalars["bn_epsilon"] = 1e-3
                operands += [a.astype(np.float64) for a in (scale, shift, mean, var)]
            elif letter == "S":
                z = jnp.asarray(rng.standard_normal(sig.output_shape), dtype)
                args.set_side_input_add(op, z, alpha=0.75)
                scalars["side_alpha"] = 0.75
                operands.append(np.asarray(z, np.float64))
            elif letter == "A":
                mode = jf.activations.activation_mode(self.activation)
                a, b, g = ACT_PARAMS.get(mode, DEFAULT_PARAMS[mode])
                args.set_activation_forward(op, alpha=a, beta=b, gamma=g)
                scalars.update(act_alpha=a, act_beta=b, act_gamma=g)
        operands.append(np.asarray([scalars[k] for k in SCALARS], np.float32).astype(np.float64))
        return x, args, operands

    def tolerance(self, device: Any) -> float:
        dt = np.dtype(jnp.dtype(self.dtype))
        if dt == np.float32 and (device.platform == "cpu" or self.precision == "highest"):
            return TOLERANCE_EXACT_FP32
        return TOLERANCE[dt]


# Depthwise convolutions (NHWC activations, HWIO filters) at the edges of the GPU's tiled
# depthwise kernel (csrc/kernels/conv_depthwise.cuh): sizes that are not multiples of its tiles,
# strides (2 and 3, unequal), dilation, asymmetric and negative padding, channel counts that
# are not a multiple of its channel slice or of 16 bytes (and odd ones, which fp16/bf16 leave
# to the direct kernel), batch 1, the side input, per-activation batch norm, and filters from
# 1x1 to 9x9 (larger than the input, too; beyond what fits in registers, the vector kernel).
def depthwise_case(c: int, **kwargs: Any) -> Case:
    """A depthwise (multiplier 1) NHWC/HWIO case with `c` channels."""
    return Case(**{"c": c, "k": c, "groups": c, "layout": "NHWC", "filter_layout": "HWIO",
                   **kwargs})


DEPTHWISE_CASES = [
    depthwise_case(64, n=2, h=13, w=11),
    depthwise_case(96, n=1, h=17, w=23, strides=(2, 2), activation="clipped_relu"),
    depthwise_case(40, ops="CBNSA", n=3, h=9, w=12, padding="SAME"),
    depthwise_case(48, ops="CNA", bn_mode="per_activation", n=2, h=10, w=7),
    depthwise_case(6, ops="CBA", n=2, h=8, w=9, activation="elu"),
    depthwise_case(144, n=2, h=14, w=14, strides=(2, 1), padding=((0, 2), (1, 1))),
    depthwise_case(32, ops="CBA", n=2, h=15, w=16, dilation=(2, 3), padding="SAME"),
    depthwise_case(16, ops="CA", n=2, h=12, w=10, padding=((-1, 0), (2, -1))),
    depthwise_case(32, r=5, s=5, n=2, h=12, w=12, padding=((2, 2), (2, 2))),
    depthwise_case(16, r=7, s=7, n=1, h=9, w=9, strides=(2, 2), padding="SAME"),
    depthwise_case(16, ops="CBA", r=9, s=9, n=1, h=10, w=10, padding="SAME"),
    depthwise_case(8, r=1, s=1, padding="VALID", n=2, h=5, w=6),
    depthwise_case(32, n=1, h=1, w=1),
    depthwise_case(8, r=5, s=5, padding=((4, 4), (4, 4)), h=3, w=4),
    depthwise_case(5, n=2, h=7, w=6),
    depthwise_case(24, ops="CBNSA", n=4, h=30, w=33, strides=(3, 2), padding=((2, 0), (1, 1))),
]


# Layers large enough that the depthwise solver also offers its best tiling walking 2 and 4
# tiles a CTA (two windows in shared memory): a last CTA with 1, 2 or 3 tiles of its walk (37,
# 38 and 39 images of one 7x7 tile), partial tiles, stride 2, 4-byte copies (20 channels), a
# side input, per-activation batch norm, each dtype.
WALKING_DEPTHWISE_CASES = [
    depthwise_case(192, n=32, h=28, w=28, dtype="bfloat16", activation="clipped_relu"),
    depthwise_case(960, n=37, h=7, w=7, dtype="bfloat16", ops="CBNSA"),
    depthwise_case(960, n=38, h=7, w=7, dtype="bfloat16", ops="CBNSA"),
    depthwise_case(960, n=39, h=7, w=7, dtype="float16"),
    depthwise_case(20, n=160, h=28, w=28, dtype="bfloat16"),
    depthwise_case(96, n=16, h=56, w=56, strides=(2, 2), dtype="float16"),
    depthwise_case(144, n=16, h=28, w=28, dtype="float32", padding="SAME"),
    depthwise_case(64, n=24, h=20, w=18, dtype="float32", bn_mode="per_activation", ops="CNA"),
]


# The same geometries in NCHW (the planar depthwise kernel), with each filter layout.
PLANAR_DEPTHWISE_CASES = [
    dataclasses.replace(case, layout="NCHW", filter_layout=("OIHW", "HWIO", "OHWI")[i % 3])
    for i, case in enumerate(DEPTHWISE_CASES)
]


def depthwise_solver(case: Case) -> str:
    """The GPU solver of a depthwise case's first kernel variant: NHWC's depthwise kernels need
    whole 32-bit words of channels (an even count in fp16/bf16); NCHW's planar kernel takes
    filters of up to 9x9 taps."""
    if case.layout == "NCHW":
        return "conv_planes" if case.r * case.s <= 81 else "conv_direct"
    return "conv_depthwise" if case.dtype == "float32" or case.c % 2 == 0 else "conv_direct"


def depthwise_solvers(case: Case) -> set[str]:
    """The solvers autotuning may keep for a depthwise case: in NCHW it times the planar kernel
    against conv_direct (test_gpu_runtime forces the planar one over these cases)."""
    first = depthwise_solver(case)
    return {first, "conv_direct"} if first == "conv_planes" else {first}


def suite_layers(*suites: str, depthwise: bool | None = None) -> list[Any]:
    """The benchmark suites' layers (`jaxfuse.bench.layers.SUITES`), in order; `depthwise` keeps
    only the grouped ones (True) or only the others (False)."""
    from jaxfuse.bench.layers import SUITES

    return [layer for suite in suites for layer in SUITES[suite]
            if depthwise is None or (layer.groups > 1) == depthwise]


def layer_case(layer: Any, *, dtype: str, layout: str, n: int) -> Case:
    """A benchmark-suite layer as the benchmarks run it: its chain (CBNA, or CBN without an
    activation), OIHW filters with NCHW and HWIO filters with NHWC."""
    return Case(ops="CBNA" if layer.activation else "CBN", dtype=dtype, layout=layout,
                filter_layout="OIHW" if layout == "NCHW" else "HWIO", n=n, c=layer.c,
                k=layer.k, h=layer.hw, w=layer.hw, r=layer.r, s=layer.r,
                strides=(layer.stride,) * 2, padding=((layer.pad, layer.pad),) * 2,
                groups=layer.groups, activation=layer.activation or "relu")


def relative_error(out: Any, ref: np.ndarray) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not np.isnan(out).any(), "output has NaN"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def run_case(case: Case, device: Any, seed: int = 0, jit: bool = True,
             solver: str | None = None) -> float:
    """Compiles (with solver mode `solver`), executes and checks one case on `device`; returns
    the relative error."""
    rng = np.random.default_rng(seed)
    plan, handles = case.build()
    plan.compile(device, solver=solver)
    x, args, operands = case.random_args(plan, handles, rng)
    x, args = jax.device_put((x, args), device)
    run = jax.jit(plan.execute) if jit else plan.execute
    out = run(x, args)
    assert out.shape == plan.output_desc.shape
    assert out.dtype == plan.output_desc.dtype
    ref = reference_float64(plan.signature, *operands)
    err = relative_error(out, ref)
    assert err <= case.tolerance(device), f"{case}: relative error {err:.3g}"
    return err


def run_forced_cases(cases: list[Case], device: Any,
                     expect: Callable[[dict[str, Any]], bool]) -> None:
    """Compiles each case with the fused kernel forced, asserts `expect(kernel_info)` (the
    kernel a test is about is the one that ran), and checks it with :func:`run_case`."""
    for case in cases:
        plan, _ = case.build()
        plan.compile(device, solver="fused")
        info = plan.kernel_info
        assert expect(info), (str(case), info)
        run_case(case, device, solver="fused")


def assert_matches_with_nonfinite(out: Any, ref: np.ndarray, tol: float) -> None:
    """NaN exactly where the reference has NaN, the same infinities, the rest within `tol`."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), "NaN positions differ")
    inf = np.isinf(ref)
    np.testing.assert_array_equal(out[inf], ref[inf], "infinities differ")
    finite = np.isfinite(ref)
    assert np.isfinite(out[finite]).all(), "non-finite output where the reference is finite"
    err = np.linalg.norm(out[finite] - ref[finite]) / max(np.linalg.norm(ref[finite]), 1e-30)
    assert err <= tol, f"relative error {err:.3g}"


def run_case_with_infinities(case: Case, device: Any, seed: int = 1) -> None:
    """Runs `case` with six infinities (three of each sign) in its input, fused kernel forced,
    and checks NaN, infinities and the finite rest against the float64 reference."""
    plan, handles = case.build()
    plan.compile(device, solver="fused")
    rng = np.random.default_rng(seed)
    x, args, operands = case.random_args(plan, handles, rng)
    x = np.asarray(x).copy()
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, 6, replace=False)] = [np.inf, -np.inf] * 3
    operands[0] = np.asarray(x, np.float64)
    ref = reference_float64(plan.signature, *operands)
    out = jax.jit(plan.execute)(jax.device_put(jnp.asarray(x), device),
                                jax.device_put(args, device))
    assert_matches_with_nonfinite(out, ref, case.tolerance(device))


def compiler_available(platform: str = "CUDA") -> bool:
    """Whether the runtime compiler of "CUDA" (NVRTC) or "ROCM" (hiprtc) can be loaded here."""
    try:
        jf._extension.extension().gpu_compiler(platform)
        return True
    except RuntimeError:
        return False


# ----- plan strings edited at random (fuzzing the parser and the handlers) -----------------------

# Payloads that would matter if a plan's text reached the compiler or a log line.
PLAN_PAYLOADS = ["\n#error JF_INJECTED\n", '\n#include "/proc/self/environ"\n', "\n#define C 0\n",
                 "*/", "/*", "\\\n", "\r\n", "\x00", "\x1b[2J", "\u2028", "\U0001f600", "é",
                 "%s%n", "${HOME}", "'\"", " ", "\t"]


def edited_plan(draw: Any, plan: str, edits: tuple[int, int]) -> str:
    """`plan` after `edits` (min, max) random edits drawn with hypothesis's `draw`: numbers
    replaced or respelled with leading zeros, characters and payloads inserted, deleted or
    replaced, fields dropped, repeated (also with a payload as their value) or moved, the
    string cut short."""
    from hypothesis import strategies as st

    numbers = st.one_of(st.integers(-3, 40), st.sampled_from(
        [0, 2**31 - 1, 2**31, 2**32 + 1, 2**62, 2**63, -(2**63), 10**30, 1 << 30, -(1 << 30)]))
    chars = st.sampled_from(list(";=,-_+0123456789CBNSAXfNHWCOIs#\n\r\x00\x7fé ")
                            + PLAN_PAYLOADS)
    for _ in range(draw(st.integers(*edits))):
        fields = plan.split(";")
        kind = draw(st.sampled_from(["number", "number", "insert", "delete", "replace", "drop",
                                     "repeat", "payload", "swap", "swap", "truncate", "zeros",
                                     "zeros"]))
        if kind in ("number", "zeros"):
            spans = [m.span() for m in re.finditer(r"-?\d+", plan)]
            if spans:
                a, b = draw(st.sampled_from(spans))
                new = str(draw(numbers)) if kind == "number" else "000" + plan[a:b].lstrip("-")
                plan = plan[:a] + new + plan[b:]
        elif kind in ("insert", "delete", "replace") and plan:
            i = draw(st.integers(0, len(plan) - 1))
            char = draw(chars)
            plan = {"insert": plan[:i] + char + plan[i:], "delete": plan[:i] + plan[i + 1:],
                    "replace": plan[:i] + char + plan[i + 1:]}[kind]
        elif kind in ("drop", "repeat", "payload", "swap") and len(fields) > 1:
            i = draw(st.integers(1, len(fields) - 1))
            j = draw(st.integers(1, len(fields) - 1))
            key = fields[i].split("=")[0]
            if kind == "drop":
                del fields[i]
            elif kind == "repeat":
                fields.insert(j, fields[i])
            elif kind == "payload":  # a repeated field carrying code (the injection forgery)
                fields.insert(j, f"{key}={draw(st.sampled_from(PLAN_PAYLOADS))}")
            else:
                fields[i], fields[j] = fields[j], fields[i]
            plan = ";".join(fields)
        elif kind == "truncate":
            plan = plan[: draw(st.integers(0, len(plan)))]
    return plan

