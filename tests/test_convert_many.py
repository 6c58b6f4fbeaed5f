"""``jaxfuse.convert.convert_many``: many float conversions as one op (one GPU kernel), bit for
bit what ``lax.convert_element_type`` gives, under jit, grad, vmap and export; and the host side
of the GPU handler (segment tables split at the 4 KB parameter limit), which needs no GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxfuse as jf
from jaxfuse._extension import extension
from jaxfuse.convert import convert_many, convert_many_p

F32, F16, BF16 = np.dtype(np.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
PAIRS = [(s, d) for s, d in itertools.permutations((F32, F16, BF16), 2)]
BITS = {F32: np.uint32, F16: np.uint16, BF16: np.uint16}


def _f32_values(n: int, rng: np.random.Generator) -> np.ndarray:
    """float32 values that matter to a conversion: random bit patterns (every class, NaNs with
    random payloads and signs), ties at bfloat16's and float16's rounding points, both sides of
    float16's overflow and subnormal bounds, denormals, zeros and infinities."""
    random_bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    # Exactly halfway between two bfloat16 values (odd and even), and two float16 values.
    bf16_ties = (rng.integers(0, 2**16, n, dtype=np.uint32) << 16) | 0x8000
    f16_ties = (rng.integers(0x38800000 >> 13, 0x477FE000 >> 13, n, dtype=np.uint32) << 13) | 0x1000
    special = np.array([
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7FBFFFFF, 0xFFFFFFFF,
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF,
        0x00400000, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7FFFFF,
        0x477FF000, 0x477FEFFF, 0x477FE000, 0xC77FF000, 0x33800000, 0x33000000, 0x33000001,
        0x337FFFFF, 0x38800000, 0x387FE000, 0x387FF000, 0x3F808000, 0x3F818000, 0x3F800001,
    ], np.uint32)
    values = np.concatenate([random_bits, bf16_ties, f16_ties, special]).view(np.float32)
    finite = rng.standard_normal(n).astype(np.float32)
    return np.concatenate([values, finite])


def _values(dtype: np.dtype, rng: np.random.Generator, n: int = 1 << 14) -> np.ndarray:
    if dtype == F32:
        return _f32_values(n, rng)
    return np.arange(1 << 16, dtype=np.uint16).view(dtype)  # every 16-bit pattern


def _bits(array: jax.Array) -> np.ndarray:
    host = np.asarray(array)
    return host.view(BITS[np.dtype(host.dtype)])


def _reference(values: list, dtypes: list) -> list:
    return jax.jit(lambda *v: [lax.convert_element_type(a, d) for a, d in zip(v, dtypes)])(
        *values)


def _assert_same_bits(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype)
        gb, wb = _bits(g), _bits(w)
        bad = np.flatnonzero(gb.reshape(-1) != wb.reshape(-1))
        assert bad.size == 0, (f"value {i}: {bad.size} elements differ, e.g. at {bad[:5]}: "
                               f"{gb.reshape(-1)[bad[:5]]} != {wb.reshape(-1)[bad[:5]]}")


# ----- the conversion itself ----------------------------------------------------------------------
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda d: np.dtype(d).name)
def test_bit_identical_to_convert_element_type(device, src: np.dtype, dst: np.dtype) -> None:
    rng = np.random.default_rng(7)
    values = _values(src, rng)
    # Several lengths in one call: whole 16-byte chunks, leftovers, a single element.
    pieces = [values, values[3:], values[: 8 * 37 + 5], values[:1], values[5:5 + 64]]
    args = [jax.device_put(p, device) for p in pieces]
    dtypes = [dst] * len(args)
    got = jax.jit(lambda *v: convert_many(v, dtypes))(*args)
    _assert_same_bits(got, _reference(args, dtypes))


def test_every_pair_in_one_call_and_shapes(device) -> None:
    rng = np.random.default_rng(3)
    shapes = [(3, 3, 64, 64), (7,), (1, 1, 5, 3), (2, 9), (), (4, 0)]
    args, dtypes = [], []
    for i, (src, dst) in enumerate(itertools.islice(itertools.cycle(PAIRS), 13)):
        shape = shapes[i % len(shapes)]
        size = int(np.prod(shape))
        flat = _values(src, rng)
        args.append(jax.device_put(np.resize(flat[rng.permutation(flat.size)], size)
                                   .reshape(shape), device))
        dtypes.append(dst)
    got = jax.jit(lambda *v: convert_many(v, dtypes))(*args)
    _assert_same_bits(got, _reference(args, dtypes))


def test_more_values_than_one_launch_takes(device) -> None:
    """Beyond the 96 segments of one kernel's parameters, the handler launches again."""
    rng = np.random.default_rng(5)
    args = [jax.device_put(_f32_values(16 + i, rng)[: 8 * (i % 5) + i % 8 + 1], device)
            for i in range(211)]
    dtypes = [BF16 if i % 3 else F16 for i in range(len(args))]
    got = jax.jit(lambda *v: convert_many(v, dtypes))(*args)
    _assert_same_bits(got, _reference(args, dtypes))


def test_eager_and_pass_through() -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 4)), jnp.float32)
    y = jnp.ones(3, jnp.bfloat16)
    a, b = convert_many([x, y], [jnp.bfloat16, jnp.bfloat16])
    assert b is y  # already its dtype: takes no part
    _assert_same_bits([a], [x.astype(jnp.bfloat16)])


def test_refuses_what_it_cannot_convert() -> None:
    with pytest.raises(TypeError, match="int32"):
        convert_many([jnp.arange(3)], [jnp.float16])
    with pytest.raises(TypeError, match="float64"):
        convert_many([jnp.ones(3)], [np.float64])
    with pytest.raises(ValueError, match="2 values and 1 dtypes"):
        convert_many([jnp.ones(3), jnp.ones(2)], [jnp.float16])
    with pytest.raises(TypeError, match="float32 -> float32"):
        convert_many_p.bind(jnp.ones(3), new_dtypes=(F32,))


def test_abstract_evaluation_needs_no_backend() -> None:
    out = jax.eval_shape(lambda a, b: convert_many([a, b], [jnp.bfloat16, jnp.float32]),
                         jax.ShapeDtypeStruct((2, 3), jnp.float32),
                         jax.ShapeDtypeStruct((4,), jnp.float16))
    assert [(o.shape, o.dtype) for o in out] == [((2, 3), BF16), ((4,), F32)]


# ----- transformations ----------------------------------------------------------------------------
def _inputs(device) -> list:
    rng = np.random.default_rng(11)
    return [jax.device_put(jnp.asarray(rng.standard_normal(s), d), device)
            for s, d in (((3, 4), F32), ((5,), BF16), ((2, 2, 3), F16))]


DTYPES = [BF16, F32, BF16]


def _loss(convert, *values):
    outs = convert(values)
    return sum(jnp.sum(jnp.sin(o.astype(jnp.float32)) * (i + 1)) for i, o in enumerate(outs))


def _ours(values):
    return convert_many(values, DTYPES)


def _plain(values):
    return [lax.convert_element_type(v, d) for v, d in zip(values, DTYPES)]


def _exact(fn):
    """`fn` jitted with every conversion rounding as written: by default XLA may skip a
    float32 -> bfloat16 -> float32 round trip ("excess precision", seen on an H100), which
    the batched op, one opaque call, never does."""
    def run(*args):
        compiled = jax.jit(fn).lower(*args).compile(
            compiler_options={"xla_allow_excess_precision": False})
        return compiled(*args)
    return run


def test_grad_matches_convert_element_type(device) -> None:
    args = _inputs(device)
    argnums = (0, 1, 2)
    got = jax.jit(jax.grad(lambda *v: _loss(_ours, *v), argnums=argnums))(*args)
    want = _exact(jax.grad(lambda *v: _loss(_plain, *v), argnums=argnums))(*args)
    _assert_same_bits(list(got), list(want))
    # Differentiating some operands only: the others take no part in the tangent's op.
    got = jax.grad(lambda a: _loss(_ours, a, args[1], args[2]))(args[0])
    want = jax.grad(lambda a: _loss(_plain, a, args[1], args[2]))(args[0])
    _assert_same_bits([got], [want])


def test_jvp_and_second_order(device) -> None:
    args = _inputs(device)
    tangents = [jnp.ones_like(a) * 0.5 for a in args]
    got = jax.jvp(lambda *v: _ours(v), args, tangents)
    want = jax.jvp(lambda *v: _plain(v), args, tangents)
    _assert_same_bits(list(got[0]) + list(got[1]), list(want[0]) + list(want[1]))
    hess = jax.hessian(lambda a: _loss(_ours, a, args[1], args[2]))(args[0])
    ref = jax.hessian(lambda a: _loss(_plain, a, args[1], args[2]))(args[0])
    np.testing.assert_array_equal(np.asarray(hess), np.asarray(ref))


def test_vmap_keeps_each_batch_dimension(device) -> None:
    rng = np.random.default_rng(2)
    a = jax.device_put(rng.standard_normal((4, 3, 5)).astype(np.float32), device)
    b = jax.device_put(jnp.asarray(rng.standard_normal((6,)), jnp.bfloat16), device)
    c = jax.device_put(jnp.asarray(rng.standard_normal((2, 3)), jnp.float16), device)

    def f(a, b, c):
        return convert_many([a, b, c], [jnp.bfloat16, jnp.float16, jnp.float32])

    got = jax.jit(jax.vmap(f, in_axes=(1, None, 1), out_axes=[0, None, 1]))(a, b, c)
    want = (jnp.moveaxis(a, 1, 0).astype(jnp.bfloat16), b.astype(jnp.float16),
            c.astype(jnp.float32))
    _assert_same_bits(list(got), list(want))


def test_export_round_trip(device) -> None:
    platform = "cuda" if device.platform == "gpu" else device.platform
    args = _inputs(device)

    def f(*v):
        return convert_many(v, DTYPES)

    exported = jax.export.export(jax.jit(f), platforms=(platform,),
                                 disabled_checks=jf.export_disabled_checks())(*args)
    restored = jax.export.deserialize(exported.serialize())
    _assert_same_bits(list(restored.call(*args)), _plain(args))


def test_lowering_per_platform() -> None:
    """GPUs get the one custom call; the CPU XLA's own converts (launches cost it nothing, and
    XLA vectorizes and threads them), so exporting for the CPU needs no disabled check."""
    args = _inputs(jax.devices("cpu")[0])
    traced = jax.jit(lambda *v: convert_many(v, DTYPES)).trace(*args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("@jaxfuse_convert_many") == 1 and "stablehlo.convert" not in cuda
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call" not in cpu and cpu.count("stablehlo.convert") == 3
    jax.export.export(jax.jit(lambda *v: convert_many(v, DTYPES)), platforms=("cpu",))(*args)
    with pytest.raises(ValueError, match="custom call"):
        jax.export.export(jax.jit(lambda *v: convert_many(v, DTYPES)),
                          platforms=("cuda",))(*args)
    both = jax.export.export(jax.jit(lambda *v: convert_many(v, DTYPES)),
                             platforms=("cpu", "cuda"),
                             disabled_checks=jf.export_disabled_checks())(*args)
    assert "jaxfuse_convert_many" in both.mlir_module()
    _assert_same_bits(list(jax.export.deserialize(both.serialize()).call(*args)), _plain(args))


# ----- the handler's segment tables (host code, no GPU needed) ------------------------------------
def _requests(sizes: list[int], aligned: bool = True) -> list[tuple[int, int, int, int, int]]:
    requests, address = [], 1 << 20
    for i, size in enumerate(sizes):
        src, dst = address, address + (1 << 19)
        if not aligned and i % 2:
            src += 4  # a float32 source 4 bytes off a 16-byte boundary
        requests.append((src, dst, size, 0, 2 if i % 2 else 1))
        address += 1 << 20
    return requests


def test_tables_number_items_across_segments() -> None:
    sizes = [1000, 7, 0, 8, 17, 3]
    tables = extension().convert_tables(_requests(sizes, aligned=False))
    assert len(tables) == 1
    items, segments = tables[0]
    assert [s[2] for s in segments] == [s for s in sizes if s]  # empty requests are skipped
    first, pairs = 0, []
    for src, dst, elements, start, codes in segments:
        vectorized = bool(codes >> 8 & 1)
        assert vectorized == (src % 16 == 0 and dst % 16 == 0)
        assert start == first
        chunks = elements // 8 if vectorized else 0
        first += chunks + elements - 8 * chunks
        pairs.append((codes & 15, codes >> 4 & 15))
    assert items == first
    assert pairs[0] == (0, 1) and pairs[1] == (0, 2)  # float32 -> float16, -> bfloat16


@pytest.mark.parametrize("count", [95, 96, 97, 192, 250])
def test_tables_split_at_the_parameter_limit(count: int) -> None:
    tables = extension().convert_tables(_requests([8 * (i % 7) + 1 for i in range(count)]))
    limit = 96  # kMaxConvertSegments (csrc/kernels/convert_table.h)
    assert [len(t[1]) for t in tables] == [limit] * (count // limit) + \
        ([count % limit] if count % limit else [])
    assert sum(t[0] for t in tables) == sum(
        (8 * (i % 7) + 1) // 8 + (8 * (i % 7) + 1) % 8 for i in range(count))
    for items, segments in tables:  # each launch numbers its own items from 0
        assert segments[0][3] == 0 and items > segments[-1][3]


def test_tables_refuse_a_pair_that_is_not_a_conversion() -> None:
    with pytest.raises(ValueError, match="float16 to float16"):
        extension().convert_tables([(16, 32, 8, 1, 1)])
    with pytest.raises(ValueError, match="unsupported"):
        extension().convert_tables([(16, 32, 8, 0, 7)])
