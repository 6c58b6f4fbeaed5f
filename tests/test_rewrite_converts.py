"""jaxfuse.fuse batches the float conversions only fused calls read (Flax's float32 filters
converted to the computation dtype on every call) into one ``jaxfuse_convert_many`` op per
scope: one GPU kernel instead of one each. Results are bit-identical to the same program with
the conversions left as they were; conversions something else needs, chains left to XLA, and
lone conversions are left exactly as the program wrote them."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxfuse as jf
from jaxfuse._extension import FFI_TARGET, RECORD_TARGET
from jaxfuse.convert import convert_many_p

fuse_module = importlib.import_module("jaxfuse.rewrite.fuse")  # the package exports fuse()

BF16 = jnp.bfloat16
HWIO = ("NHWC", "HWIO", "NHWC")


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=HWIO)


def _filters(rng: np.random.Generator, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """float32 filters that exercise the conversion: random values, values halfway between two
    bfloat16 values (ties round to even), denormals and values that round up a binade."""
    filters = []
    for shape in shapes:
        w = (rng.standard_normal(shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)
        flat = w.reshape(-1).view(np.uint32)
        flat[::7] = (flat[::7] & 0xFFFF0000) | 0x8000  # ties
        flat[3::11] = (flat[3::11] & 0xFFFF0000) | 0x7FFF  # just below a tie
        flat[5::13] = rng.integers(1, 0x7FFFFF, flat[5::13].size, dtype=np.uint32)  # denormals
        flat[9::17] = 0x3F7FFFFF  # rounds up to 1.0
        filters.append(w)
    return filters


class Net:
    """Three bfloat16 conv -> bias -> relu layers whose filters are float32 parameters
    converted on every call, as Flax's Conv(dtype=bfloat16, param_dtype=float32) does."""

    def __init__(self, seed: int = 0, c: int = 8):
        rng = np.random.default_rng(seed)
        self.filters = _filters(rng, [(3, 3, 4, c), (1, 1, c, c), (3, 3, c, c)])
        self.biases = [jnp.asarray(rng.standard_normal(c), BF16) for _ in range(3)]
        self.x = jnp.asarray(rng.standard_normal((2, 9, 9, 4)), BF16)

    @staticmethod
    def apply(params: dict[str, Any], x: jax.Array) -> jax.Array:
        for w, b in zip(params["w"], params["b"]):
            x = jax.nn.relu(_conv(x, w.astype(BF16)) + b)
        return x

    def args(self, device: Any = None) -> tuple[Any, ...]:
        params = {"w": [jnp.asarray(w) for w in self.filters], "b": self.biases}
        return jax.device_put((params, self.x), device)


def _unbatched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fuse_module, "plan_convert_batch", lambda g, groups: None)


def _run(fn: Callable[..., Any], args: tuple[Any, ...], device: Any,
         solver: str = "fused") -> Any:
    with jax.default_device(device):
        return jax.jit(jf.fuse(fn, solver=solver))(*args)


def _bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_identical(got: Any, want: Any) -> None:
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))


def _equations(closed: Any, name: str) -> int:
    return sum(e.primitive.name == name for e in closed.jaxpr.eqns)


def _filter_converts(closed: Any) -> list[tuple[int, ...]]:
    """The shapes of the float32 -> bfloat16 conversions of filters left in a program (the
    rewrite widens bfloat16 biases to float32 for the kernel: those are not counted)."""
    return [e.invars[0].aval.shape for e in closed.jaxpr.eqns
            if e.primitive.name == "convert_element_type" and e.invars[0].aval.ndim == 4
            and e.invars[0].aval.dtype == jnp.float32 and e.outvars[0].aval.dtype == BF16]


def _cuda_custom_calls(fn: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, int]:
    """Custom-call targets in the program lowered for CUDA (no GPU needed to lower)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # (The fused chain's registration with the record stage, where the backend has one, is
    # the same kernel: counted under the plain name.)
    targets = [t.replace(RECORD_TARGET, FFI_TARGET)
               for t in re.findall(r"stablehlo\.custom_call @(\w+)", text)]
    return {t: targets.count(t) for t in set(targets)}


# ----- what is batched --------------------------------------------------------------------------
def test_filters_are_converted_in_one_op(device, monkeypatch) -> None:
    net = Net()
    args = net.args(device)
    fused = jf.fuse(Net.apply, solver="fused")
    report = jf.fusion_report(fused, *args)
    assert report.fused_calls == 3 and report.converts_batched == 3
    assert "3 conversions" in report.summary()
    assert _equations(report.jaxpr, "jaxfuse_convert_many") == 1
    assert _filter_converts(report.jaxpr) == []
    assert _cuda_custom_calls(fused, args) == {"jaxfuse_convert_many": 1,
                                               "jaxfuse_fused_chain": 3}
    got = _run(Net.apply, args, device)
    _unbatched(monkeypatch)
    _assert_identical(got, _run(Net.apply, args, device))
    ref = jax.jit(Net.apply)(*args)
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) / \
        np.linalg.norm(np.asarray(ref, np.float64))
    assert err < 2.5e-2


def test_nonfinite_filters(device, monkeypatch) -> None:
    net = Net(seed=1)
    net.filters[0][0, 0, 0, 1] = np.nan
    net.filters[1][0, 0, 2, 3] = np.inf
    net.filters[2][1, 1, 0, 5] = -np.inf
    net.filters[2][2, 0, 3, 6] = np.float32(np.finfo(np.float32).max)  # bfloat16 infinity
    args = net.args(device)
    got = _run(Net.apply, args, device)
    assert np.isnan(np.asarray(got, np.float32)).any()
    _unbatched(monkeypatch)
    _assert_identical(got, _run(Net.apply, args, device))


def test_grad_through_the_fused_program(device, monkeypatch) -> None:
    net = Net(seed=2)
    args = net.args(device)

    def loss(params: dict[str, Any], x: jax.Array) -> jax.Array:
        return jnp.sum(jf.fuse(Net.apply, solver="fused")(params, x).astype(jnp.float32) ** 2)

    with jax.default_device(device):
        got = jax.jit(jax.grad(loss))(*args)
        # One batched conversion forward, and its transpose: the cotangents converted back.
        assert _equations(jax.make_jaxpr(jax.grad(loss))(*args), "jaxfuse_convert_many") == 2
        _unbatched(monkeypatch)
        unbatched = jax.jit(jax.grad(loss))(*args)
    if device.platform == "cpu":
        _assert_identical(got, unbatched)
    want = jax.jit(jax.grad(lambda p, x: jnp.sum(Net.apply(p, x).astype(jnp.float32) ** 2)))(
        *args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 5e-2 * np.linalg.norm(w)


def test_vmap_and_export_of_a_fused_program(device, monkeypatch) -> None:
    net = Net(seed=3)
    params, x = net.args(device)
    xs = jnp.stack([x, -x])
    platform = "cuda" if device.platform == "gpu" else device.platform
    with jax.default_device(device):
        fused = jax.jit(jax.vmap(jf.fuse(Net.apply, solver="fused"), in_axes=(None, 0)))
        got = fused(params, xs)
        exported = jax.export.export(fused, platforms=(platform,),
                                     disabled_checks=jf.export_disabled_checks())(params, xs)
        _assert_identical(jax.export.deserialize(exported.serialize()).call(params, xs), got)
        _unbatched(monkeypatch)
        want = jax.jit(jax.vmap(jf.fuse(Net.apply, solver="fused"), in_axes=(None, 0)))(
            params, xs)
    _assert_identical(got, want)


# ----- what is left alone -----------------------------------------------------------------------
def test_nothing_is_batched_when_xla_runs_the_chains() -> None:
    args = Net().args()
    report = jf.fusion_report(jf.fuse(Net.apply, solver="xla"), *args)
    assert report.converts_batched == 0 and report.fused_calls == 0
    assert len(_filter_converts(report.jaxpr)) == 3
    assert "jaxfuse_convert_many" not in str(report.jaxpr)


def test_one_conversion_is_left_as_it_is() -> None:
    net = Net()
    params, x = net.args()
    params["w"][1] = params["w"][1].astype(BF16)  # two filters already in the data dtype
    params["w"][2] = params["w"][2].astype(BF16)
    report = jf.fusion_report(jf.fuse(Net.apply, solver="fused"), params, x)
    assert report.fused_calls == 3 and report.converts_batched == 0
    assert _filter_converts(report.jaxpr) == [(3, 3, 4, 8)]


def test_a_converted_copy_needed_elsewhere_keeps_its_conversion(monkeypatch) -> None:
    net = Net(seed=4)
    args = net.args()

    def returns_one_copy(params: dict[str, Any], x: jax.Array) -> tuple[jax.Array, jax.Array]:
        w16 = [w.astype(BF16) for w in params["w"]]
        for w, b in zip(w16, params["b"]):
            x = jax.nn.relu(_conv(x, w) + b)
        return x, w16[1]  # the function returns one converted filter

    def uses_one_copy_twice(params: dict[str, Any], x: jax.Array) -> jax.Array:
        w16 = [w.astype(BF16) for w in params["w"]]
        for w, b in zip(w16, params["b"]):
            x = jax.nn.relu(_conv(x, w) + b)
        return x * jnp.sum(w16[2])  # an unfused reduction reads one converted filter

    for fn in (returns_one_copy, uses_one_copy_twice):
        report = jf.fusion_report(jf.fuse(fn, solver="fused"), *args)
        assert report.fused_calls == 3 and report.converts_batched == 2, fn.__name__
        assert len(_filter_converts(report.jaxpr)) == 1
        got = jax.jit(jf.fuse(fn, solver="fused"))(*args)
        with monkeypatch.context() as patch:
            _unbatched(patch)
            _assert_identical(got, jax.jit(jf.fuse(fn, solver="fused"))(*args))


def test_a_chain_left_to_xla_keeps_its_conversion(monkeypatch) -> None:
    """In auto mode the program's choice may leave chains to XLA (choice.py); their
    conversions stay exactly as written. Simulated here: the second chain goes to XLA."""
    original = fuse_module.Rewriter._program_choice

    def second_to_xla(self, groups):
        solvers = original(self, groups)
        solvers[id(groups[1])] = "xla"
        return solvers

    monkeypatch.setattr(fuse_module.Rewriter, "_program_choice", second_to_xla)
    args = Net(seed=5).args()
    report = jf.fusion_report(jf.fuse(Net.apply, solver="fused"), *args)
    assert report.fused_calls == 2 and len(report.to_xla) == 1
    assert report.converts_batched == 2
    assert _filter_converts(report.jaxpr) == [(1, 1, 8, 8)]
    got = jax.jit(jf.fuse(Net.apply, solver="fused"))(*args)
    _unbatched(monkeypatch)
    _assert_identical(got, jax.jit(jf.fuse(Net.apply, solver="fused"))(*args))


# ----- where the batch goes ---------------------------------------------------------------------
def test_a_source_computed_by_a_fused_call(device, monkeypatch) -> None:
    """The batch is emitted before the first fused call that reads it; a conversion whose
    source a fused call computes joins it when that call comes earlier. Here the float32 first
    layer's output (which the function also returns, so that chain ends before the cast) is
    converted to bfloat16 for the second layer, next to two filters."""
    rng = np.random.default_rng(6)
    w0, w1, w2 = _filters(rng, [(3, 3, 4, 8), (3, 3, 8, 8), (1, 1, 8, 8)])
    x = jnp.asarray(rng.standard_normal((1, 7, 7, 4)), jnp.float32)

    def fn(w0, w1, w2, x):
        y32 = jax.nn.relu(_conv(x, w0))  # float32
        y = jax.nn.relu(_conv(y32.astype(BF16), w1.astype(BF16)))
        return jax.nn.relu(_conv(y, w2.astype(BF16))), y32

    args = jax.device_put((w0, w1, w2, x), device)
    report = jf.fusion_report(jf.fuse(fn, solver="fused"), *args)
    assert report.fused_calls == 3 and report.converts_batched == 3
    batch = next(e for e in report.jaxpr.jaxpr.eqns if e.primitive is convert_many_p)
    assert sorted(v.aval.shape for v in batch.invars) == [(1, 1, 8, 8), (1, 7, 7, 8),
                                                           (3, 3, 8, 8)]
    got = _run(fn, args, device)
    _unbatched(monkeypatch)
    _assert_identical(got, _run(fn, args, device))


def test_inside_scan_over_layers(device, monkeypatch) -> None:
    rng = np.random.default_rng(7)
    stacked = [np.stack(_filters(rng, [(3, 3, 8, 8)] * 4)),
               np.stack(_filters(rng, [(1, 1, 8, 8)] * 4))]
    x = jnp.asarray(rng.standard_normal((1, 6, 6, 8)), BF16)

    def fn(ws, x):
        def layer(y, w):
            y = jax.nn.relu(_conv(y, w[0].astype(BF16)))
            return jax.nn.relu(_conv(y, w[1].astype(BF16))), None

        return lax.scan(layer, x, ws)[0]

    args = jax.device_put((stacked, x), device)
    report = jf.fusion_report(jf.fuse(fn, solver="fused"), *args)
    assert report.fused_calls == 2 and report.converts_batched == 2
    got = _run(fn, args, device)
    _unbatched(monkeypatch)
    _assert_identical(got, _run(fn, args, device))


# ----- Flax networks ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet50", "mobilenet"])
def test_every_filter_of_a_flax_network(name: str, device, monkeypatch) -> None:
    models = pytest.importorskip("jaxfuse.bench.models")
    model = {"resnet50": lambda: models.resnet50(width=8, num_classes=10, dtype=BF16),
             "mobilenet": lambda: models.mobilenet(width_multiplier=0.35, num_classes=10,
                                                   dtype=BF16)}[name]()
    x = jax.random.normal(jax.random.key(0), (1, 64, 64, 3), BF16)
    variables = models.random_variables(model, x, seed=8)
    args = jax.device_put((variables, x), device)
    fused = jf.fuse(model.apply, solver="fused")
    report = jf.fusion_report(fused, *args)
    convs = len(report.fused)
    assert not report.left_alone and report.converts_batched == convs
    assert _equations(report.jaxpr, "jaxfuse_convert_many") == 1
    assert _cuda_custom_calls(fused, args) == {"jaxfuse_convert_many": 1,
                                               "jaxfuse_fused_chain": convs}
    got = _run(model.apply, args, device)
    _unbatched(monkeypatch)
    _assert_identical(got, _run(model.apply, args, device))


# ----- the optimized program --------------------------------------------------------------------
def test_optimized_program(device) -> None:
    """On a GPU the filters' conversions are one custom call and no XLA conversion of a filter
    is left (plain jax.jit has one fusion per filter); on the CPU the op is XLA's converts."""
    args = Net().args(device)
    with jax.default_device(device):
        text = jax.jit(jf.fuse(Net.apply, solver="fused")).lower(*args).compile().as_text()
    filter_converts = re.findall(r"= bf16\[(?:3,3,4,8|1,1,8,8|3,3,8,8)\]\{[^}]*\} "
                                 r"(?:convert|fusion)\(", text)
    assert len(re.findall(r'custom_call_target="jaxfuse_fused_chain(?:_recorded)?"', text)) == 3
    if device.platform == "cpu":
        assert "jaxfuse_convert_many" not in text and filter_converts
    else:
        assert text.count('custom_call_target="jaxfuse_convert_many"') == 1
        assert not filter_converts, filter_converts
