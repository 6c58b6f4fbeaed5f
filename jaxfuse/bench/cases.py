"""One benchmark case: a layer's fused plan and the same composition as plain jax code."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..args import OperatorArgs
from ..descriptors import ConvDesc, TensorDesc
from ..plan import FusionPlan
from .layers import SUITES, Layer

__all__ = ["BenchCase"]

EPSILON = 1e-5


@dataclasses.dataclass(frozen=True)
class BenchCase:
    layer: Layer
    n: int
    dtype: str
    layout: str
    chain: str  # "CBNA", "CBA", "NA", ... (the layer may end it before the activation)
    filters: str | None = None  # the filter layout; None: HWIO for NHWC, OIHW for NCHW
    # "float32": the filters are kept in float32 and converted to `dtype` for the
    # convolution (a Flax model's parameters): the fused plan reads them as they are, XLA's
    # composition converts them first. None: filters in `dtype`.
    filter_dtype: str | None = None

    @classmethod
    def for_layer(cls, layer: Layer | str, n: int, dtype: str, layout: str, chain: str,
                  filters: str | None = None, filter_dtype: str | None = None) -> BenchCase:
        """The case of `layer` (or the suites' layer of that name) running `chain`; layers
        without a convolution run NA on their input as it is."""
        if isinstance(layer, str):
            named = [L for suite in SUITES.values() for L in suite if L.name == layer]
            if not named:
                raise ValueError(f"no benchmark layer is named {layer!r}")
            layer = named[0]
        if not layer.has_conv:
            return cls(layer, n, dtype, layout, "NA")
        if filter_dtype is not None and np.dtype(filter_dtype) == np.dtype(dtype):
            filter_dtype = None
        return cls(layer, n, dtype, layout, chain, filters, filter_dtype)

    @property
    def ops(self) -> str:
        chain = self.chain
        if self.layer.residual and "S" not in chain:  # the add goes before the activation
            chain = chain.replace("A", "SA") if "A" in chain else chain + "S"
        return chain if self.layer.activation else chain.replace("A", "")

    @property
    def filter_layout(self) -> str:
        if self.filters is not None:
            return self.filters
        return "HWIO" if self.layout == "NHWC" else "OIHW"

    def shape(self, c: int, hw: int) -> tuple[int, ...]:
        return (self.n, c, hw, hw) if self.layout == "NCHW" else (self.n, hw, hw, c)

    def filter_shape(self) -> tuple[int, ...]:
        L = self.layer
        ci = L.c // L.groups
        return {"HWIO": (L.r, L.r, ci, L.k), "OHWI": (L.k, L.r, L.r, ci),
                "OIHW": (L.k, ci, L.r, L.r)}[self.filter_layout]

    def label(self) -> str:
        filters = f"/{self.filters}" if self.filters is not None else ""
        if self.filter_dtype is not None:
            filters += f" w:{self.filter_dtype}"
        return f"{self.layer.name} N={self.n} {self.dtype} {self.layout}{filters} {self.ops}"

    def plan(self, device: Any, solver: str = "fused") -> tuple[FusionPlan, dict[str, Any]]:
        L = self.layer
        plan = FusionPlan(TensorDesc(self.shape(L.c, L.hw), self.dtype, self.layout))
        ops: dict[str, Any] = {}
        for letter in self.ops:
            if letter == "C":
                conv = ConvDesc(L.stride, L.pad, 1, L.groups)
                ops["C"] = plan.add_conv_forward(
                    conv, TensorDesc(self.filter_shape(), self.filter_dtype or self.dtype,
                                     self.filter_layout))
            elif letter == "B":
                ops["B"] = plan.add_bias_forward(TensorDesc((L.k,), "float32"))
            elif letter == "N":
                ops["N"] = plan.add_batchnorm_inference("spatial")
            elif letter == "S":
                ops["S"] = plan.add_side_input_add()
            elif letter == "A":
                ops["A"] = plan.add_activation_forward(L.activation)
        plan.compile(device, solver=solver)
        return plan, ops

    def arg_sets(self, count: int, device: Any, seed: int = 0) -> list[tuple[Any, ...]]:
        """`count` distinct (x, w, bias, scale, shift, mean, var, z) sets on `device`; z, the
        residual, is output-shaped where the chain adds one (else one unused value)."""
        L = self.layer
        rng = np.random.default_rng(seed)
        sets = []
        for _ in range(count):
            x = rng.standard_normal(self.shape(L.c, L.hw), np.float32)
            fan_in = max(1, (L.c // L.groups) * L.r * L.r)
            w = rng.standard_normal(self.filter_shape(), np.float32) / np.sqrt(fan_in)
            b, shift, mean = (rng.standard_normal(L.k, np.float32) * 0.1 for _ in range(3))
            scale = rng.uniform(0.5, 1.5, L.k).astype(np.float32)
            var = rng.uniform(0.5, 2.0, L.k).astype(np.float32)
            z = (rng.standard_normal(self.shape(L.k, L.out_hw()), np.float32) if "S" in self.ops
                 else np.zeros(1, np.float32))
            arrays = (x.astype(self.dtype), w.astype(self.filter_dtype or self.dtype), b, scale,
                      shift, mean, var,
                      z.astype(self.dtype))
            sets.append(tuple(jax.device_put(a, device) for a in arrays))
        return sets

    def fused(self, plan: FusionPlan, ops: dict[str, Any]) -> Callable[..., Any]:
        def run(x, w, b, scale, shift, mean, var, z):
            args = OperatorArgs()
            if "C" in ops:
                args.set_conv_forward(ops["C"], w)
            if "B" in ops:
                args.set_bias_forward(ops["B"], b)
            if "N" in ops:
                args.set_batchnorm_inference(ops["N"], scale, shift, mean, var, EPSILON)
            if "S" in ops:
                args.set_side_input_add(ops["S"], z)
            if "A" in ops:
                args.set_activation_forward(ops["A"])
            return plan.execute(x, args)
        return run

    def unfused(self) -> Callable[..., Any]:
        """The chain as a user writes it in jax, in the data dtype (XLA fuses what it can)."""
        L = self.layer
        dt = jnp.dtype(self.dtype)
        channel_axis = 1 if self.layout == "NCHW" else 3
        shape = [1, 1, 1, 1]
        shape[channel_axis] = L.k

        def per_channel(v):
            return v.astype(dt).reshape(shape)

        def run(x, w, b, scale, shift, mean, var, z):
            y = x
            for letter in self.ops:
                if letter == "C":
                    y = lax.conv_general_dilated(
                        y, w.astype(dt), (L.stride, L.stride), [(L.pad, L.pad)] * 2,
                        dimension_numbers=(self.layout, self.filter_layout, self.layout),
                        feature_group_count=L.groups)
                elif letter == "B":
                    y = y + per_channel(b)
                elif letter == "N":
                    inv = per_channel(scale * lax.rsqrt(var + EPSILON))
                    y = (y - per_channel(mean)) * inv + per_channel(shift)
                elif letter == "S":
                    y = y + z
                elif letter == "A":
                    y = jax.nn.relu6(y) if L.activation == "clipped_relu" else jax.nn.relu(y)
            return y
        return run
