"""Fused plans under ``jax.jit`` on a device mesh: batch-, channel- and group-sharded operands
run the fused kernel on each shard, with no collectives in the compiled program.

On CPU this needs 8 host devices, which tests/conftest.py requests through XLA_FLAGS before
jax starts; the GPU variant runs when jax sees at least two GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from cases import Case
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from transform_cases import build, execute, relative_tree_error

import jaxfuse as jf
from jaxfuse.transforms.partitioning import shard_signature

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce",
               "reduce-scatter")


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def devices(request) -> list:
    if request.param == "cpu":
        found = jax.devices("cpu")
        if len(found) < 8:
            pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count"
                        "=8 before jax starts; tests/conftest.py sets it)")
        return found[:8]
    try:
        found = jax.devices("gpu")
    except RuntimeError:
        found = []
    if len(found) < 2:
        pytest.skip("needs at least 2 GPUs")
    return found[:len(found) - len(found) % 2]


def _mesh(devices: list, axis_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
    return jax.make_mesh((len(devices) // 2, 2), ("data", "model"),
                         axis_types=(axis_type, axis_type), devices=devices)


def _place(mesh, x, params, specs: dict[str, P]):
    """x and params on `mesh`: sharded where `specs` says, replicated elsewhere."""
    def put(name, value):
        return jax.device_put(value, NamedSharding(mesh, specs.get(name, P())))
    return put("x", x), {name: put(name, v) for name, v in params.items()}


def _padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


# (case, operand shardings, expected output sharding, shards per factor of the signature)
SHARDED_CASES = [
    pytest.param(Case(ops="CBNA", n=8), {"x": P("data")}, P("data"), {"n": 4},
                 id="batch-NCHW"),
    pytest.param(Case(ops="CBNSA", n=8, layout="NHWC", filter_layout="HWIO"),
                 {"x": P("data"), "side": P("data")}, P("data"), {"n": 4}, id="batch-NHWC-side"),
    pytest.param(Case(ops="CBNA", n=2, k=16),
                 {"w": P("model"), "bias": P("model"), "scale": P("model"),
                  "shift": P("model"), "mean": P("model"), "var": P("model")},
                 P(None, "model"), {"k": 2}, id="out-channels"),
    pytest.param(Case(ops="CBNSA", n=8, k=16, layout="NHWC", filter_layout="OHWI",
                      bn_mode="per_activation"),
                 {"x": P("data"), "w": P("model"), "bias": P("model"),
                  "scale": P(None, None, "model"), "var": P(None, None, "model"),
                  "side": P("data", None, None, "model")},
                 P("data", None, None, "model"), {"n": 4, "k": 2}, id="batch-and-out-channels"),
    pytest.param(Case(ops="CBA", n=8, c=8, k=16, groups=4, activation="elu"),
                 {"x": P("data", "model"), "w": P("model"), "bias": P("model")},
                 P("data", "model"), {"n": 4, "g": 2}, id="groups"),
    pytest.param(Case(ops="CNA", n=8, c=8, k=8, groups=8, layout="NHWC", filter_layout="HWIO",
                      strides=(2, 2), padding="SAME"),
                 {"x": P("data", None, None, "model"), "w": P(None, None, None, "model")},
                 P("data", None, None, "model"), {"n": 4, "g": 2}, id="depthwise"),
    pytest.param(Case(ops="NA", n=8, c=8, bn_mode="per_activation", activation="tanh"),
                 {"x": P("data", "model"), "scale": P("model")}, P("data", "model"),
                 {"n": 4, "c": 2}, id="pointwise-channels"),
    pytest.param(Case(ops="BSA", n=8, h=8, layout="NHWC", activation="leaky_relu"),
                 {"x": P("data", "model"), "side": P("data", "model")}, P("data", "model"),
                 {"n": 4, "h": 2}, id="pointwise-rows"),
]


@pytest.mark.parametrize("case,specs,out_spec,shards", SHARDED_CASES)
def test_sharded_operands_run_per_shard(case: Case, specs: dict, out_spec: P, shards: dict,
                                        devices) -> None:
    mesh = _mesh(devices)
    if len(devices) != 8:  # the shard counts above are for a 4x2 mesh
        shards = {f: (mesh.shape["data"] if n == 4 else n) for f, n in shards.items()}
    plan, handles, x, params = build(case)
    want = jax.jit(lambda x, p: execute(plan, handles, x, p))(
        *jax.device_put((x, params), devices[0]))
    xs, ps = _place(mesh, x, params, specs)

    def fn(x, p):
        return execute(plan, handles, x, p)

    out = jax.jit(fn)(xs, ps)
    assert relative_tree_error(out, want) <= case.tolerance(devices[0])
    assert _padded(out.sharding.spec, out.ndim) == _padded(out_spec, out.ndim)
    text = _compiled_text(fn, xs, ps)
    assert not [c for c in COLLECTIVES if c in text], text
    per_shard = shard_signature(plan.signature, shards).encode()
    assert per_shard in text


@pytest.mark.parametrize("case,specs,out_spec,shards", [SHARDED_CASES[0], SHARDED_CASES[3]])
def test_auto_mesh_axes(case: Case, specs: dict, out_spec: P, shards: dict, devices) -> None:
    # Meshes whose axes are Auto (shardings not in the types) partition the same way.
    mesh = _mesh(devices, AxisType.Auto)
    plan, handles, x, params = build(case)
    xs, ps = _place(mesh, x, params, specs)

    def fn(x, p):
        return execute(plan, handles, x, p)

    out = jax.jit(fn)(xs, ps)
    assert _padded(out.sharding.spec, out.ndim) == _padded(out_spec, out.ndim)
    assert not [c for c in COLLECTIVES if c in _compiled_text(fn, xs, ps)]


def test_eager_call_on_sharded_inputs(devices) -> None:
    case = Case(ops="CBNA", n=8, k=16)
    plan, handles, x, params = build(case)
    mesh = _mesh(devices)
    xs, ps = _place(mesh, x, params, {"x": P("data"), "w": P("model"), "bias": P("model")})
    out = execute(plan, handles, xs, ps)
    assert _padded(out.sharding.spec, 4) == ("data", "model", None, None)
    want = execute(plan, handles, *jax.device_put((x, params), devices[0]))
    assert relative_tree_error(out, want) <= case.tolerance(devices[0])


def test_vmap_over_sharded_batch(devices) -> None:
    case = Case(ops="CBNSA", n=8, layout="NHWC", filter_layout="HWIO")
    plan, handles, x, params = build(case)
    mesh = _mesh(devices)
    xs = jax.device_put(jnp.stack([x, -x, 2 * x]), NamedSharding(mesh, P(None, "data")))
    _, ps = _place(mesh, x, params, {"side": P("data")})

    def fn(x, p):
        return jax.vmap(lambda x: execute(plan, handles, x, p))(x)

    out = jax.jit(fn)(xs, ps)
    assert _padded(out.sharding.spec, 5)[:2] == (None, "data")
    assert not [c for c in COLLECTIVES if c in _compiled_text(fn, xs, ps)]
    single = jax.jit(lambda x: execute(plan, handles, x, params))
    want = jnp.stack([single(v) for v in (x, -x, 2 * x)])
    assert relative_tree_error(out, want) <= case.tolerance(devices[0])


def test_grad_under_sharding(devices) -> None:
    case = Case(ops="CBNA", n=8, k=16, activation="elu")
    plan, handles, x, params = build(case)
    mesh = _mesh(devices)
    xs, ps = _place(mesh, x, params, {"x": P("data"), "w": P("model"), "bias": P("model")})

    def grads(x, p):
        return jax.grad(lambda x, p: jnp.sum(execute(plan, handles, x, p) ** 2),
                        argnums=(0, 1))(x, p)

    gx, gp = jax.jit(grads)(xs, ps)
    assert gx.sharding.spec[0] == "data"
    want = jax.jit(grads)(*jax.device_put((x, params), devices[0]))
    assert relative_tree_error((gx, gp), want) <= case.tolerance(devices[0])


def test_export_of_a_sharded_function(devices) -> None:
    # Exported programs call the FFI target directly (no in-process partitioning callback),
    # so they stay correct on a mesh; XLA then gathers operands as for any opaque call.
    case = Case(ops="CBA", n=8, k=16)
    plan, handles, x, params = build(case)
    mesh = _mesh(devices)
    xs, ps = _place(mesh, x, params, {"x": P("data")})
    fn = jax.jit(lambda x, p: execute(plan, handles, x, p))
    exported = jax.export.export(fn, disabled_checks=jf.export_disabled_checks())(xs, ps)
    assert "CustomSPMDPartitioning" not in exported.mlir_module()
    restored = jax.export.deserialize(exported.serialize())
    out = restored.call(xs, ps)
    want = fn(*jax.device_put((x, params), devices[0]))
    assert relative_tree_error(out, want) <= case.tolerance(devices[0])


def test_gspmd_partitioner(devices) -> None:
    # The same rule through the older GSPMD partitioner (sharding callbacks, not Shardy).
    previous = getattr(jax.config, "jax_use_shardy_partitioner", None)
    if previous is None:
        pytest.skip("this jax has no GSPMD partitioner to switch to")
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        test_sharded_operands_run_per_shard(*SHARDED_CASES[3].values, devices)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def test_inside_shard_map(devices) -> None:
    # Inside shard_map the program is per shard already: the plan describes one shard and
    # lowers straight to the FFI call.
    case = Case(ops="CBNA", n=2, activation="tanh")  # one shard's batch
    plan, handles, x, params = build(case)
    mesh = _mesh(devices)
    pieces = [x * (i + 1) * (-1) ** i for i in range(mesh.shape["data"])]
    xs = jax.device_put(jnp.concatenate(pieces), NamedSharding(mesh, P("data")))

    @jax.jit
    def fn(x, p):
        return jax.shard_map(lambda x, p: execute(plan, handles, x, p), mesh=mesh,
                             in_specs=(P("data"), P()), out_specs=P("data"))(x, p)

    out = fn(xs, params)
    single = jax.jit(lambda x: execute(plan, handles, x, params))
    want = jnp.concatenate([single(v) for v in pieces])
    assert relative_tree_error(out, want) <= case.tolerance(devices[0])
    text = fn.lower(xs, params).compile().as_text()
    assert "CustomSPMDPartitioning" not in text
    assert not [c for c in COLLECTIVES if c in text]


@pytest.mark.parametrize("solver", ["fused", "auto"])
def test_data_parallel_model_runs_each_shard_alone(devices, solver) -> None:
    """A Flax ResNet with the batch sharded over two devices under jit(fuse(apply)) (the
    end-to-end benchmark's --devices mode): the single-device result, and no collective."""
    pytest.importorskip("flax")
    import numpy as np

    from jaxfuse.bench.end_to_end import collectives, place
    from jaxfuse.bench.models import ResNet, random_variables

    model = ResNet(stage_sizes=(1, 1), num_classes=10, width=8)
    x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float32)
    variables = random_variables(model, jnp.asarray(x[:1]))
    fused = jax.jit(jf.fuse(model.apply, solver=solver))
    x1, v1 = place(x, variables, devices[:1])
    one = fused(v1, x1)
    x2, v2 = place(x, variables, devices[:2])
    args = (v2, x2)
    two = fused(*args)
    assert len(two.sharding.device_set) == 2
    one, two = np.asarray(one), np.asarray(two)
    assert np.max(np.abs(two - one)) <= 1e-4 * np.max(np.abs(one))
    assert collectives(fused, *args) == 0
    assert collectives(jax.jit(lambda v, x: model.apply(v, x).sum()), *args) > 0  # control
    report = jf.fusion_report(jf.fuse(model.apply, solver=solver), *args)
    assert len(report.fused) + len(report.to_xla) >= 5
