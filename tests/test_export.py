"""``jax.export`` of programs that use jaxfuse: serialize, then deserialize and run in a fresh
process that did nothing but ``import jaxfuse``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TOLERANCE, relative_error

import jaxfuse as jf

LAYER = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
             activation="elu", activation_alpha=0.5)


def _layer(x, w, b, scale, shift, mean, var):
    """A fused conv + bias + batch-norm + elu, then a fused bias + relu on its result."""
    y = jf.conv_bias_batchnorm_activation(x, w, b, scale, shift, mean, var, epsilon=1e-3,
                                          **LAYER)
    return jf.bias_activation(y, -b, layout="NHWC", activation="relu")


def _inputs(dtype: str, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 7, 6, 4)), dtype)
    w = jnp.asarray(rng.standard_normal((3, 3, 4, 8)) / 6, dtype)
    b, shift, mean = (rng.standard_normal(8).astype(np.float32) for _ in range(3))
    scale, var = (rng.uniform(0.5, 1.5, 8).astype(np.float32) for _ in range(2))
    return x, w, b, scale, shift, mean, var


def _programs() -> dict:
    """Jitted functions worth exporting: the layer, its gradient, and a vmap of it."""
    def loss(*args):
        return jnp.sum(_layer(*args).astype(jnp.float32) ** 2)

    return {
        "forward": (jax.jit(_layer), "bfloat16"),
        "grad": (jax.jit(jax.grad(loss, argnums=tuple(range(7)))), "float32"),
        "vmap": (jax.jit(jax.vmap(_layer, in_axes=(0, None, 0, None, None, None, None))),
                 "float32"),
    }


def _args_for(name: str, dtype: str) -> tuple:
    args = _inputs(dtype)
    if name == "vmap":  # a batch of three inputs and biases
        x, w, b, *rest = args
        args = (jnp.stack([x, -x, 2 * x]), w, np.stack([b, b + 1, -b]), *rest)
    return args


FRESH_PROCESS = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    import jaxfuse  # noqa: F401  (registers the FFI target; nothing else is used)

    platform, *names = sys.argv[1:]
    device = jax.devices(platform)[0]
    for name in names:  # each: NAME.bin (the serialized export) and NAME.npz (its inputs)
        exported = jax.export.deserialize(bytearray(open(name + ".bin", "rb").read()))
        saved = np.load(name + ".npz")
        args = [jax.device_put(saved[f"arg{i}"].astype(aval.dtype), device)
                for i, aval in enumerate(exported.in_avals)]
        outputs = jax.tree_util.tree_leaves(exported.call(*args))
        np.savez(name + ".out.npz", *[np.asarray(o, np.float32) for o in outputs])
""")


def test_round_trip_in_a_fresh_process(device, tmp_path: Path) -> None:
    platform = "cuda" if device.platform == "gpu" else device.platform
    expected = {}
    for name, (fn, dtype) in _programs().items():
        args = jax.device_put(_args_for(name, dtype), device)
        exported = jax.export.export(fn, platforms=(platform,),
                                     disabled_checks=jf.export_disabled_checks())(*args)
        (tmp_path / f"{name}.bin").write_bytes(exported.serialize())
        np.savez(tmp_path / f"{name}.npz",
                 **{f"arg{i}": np.asarray(a, np.float32) for i, a in enumerate(args)})
        expected[name] = jax.tree_util.tree_leaves(fn(*args))
    run = subprocess.run(
        [sys.executable, "-P", "-c", FRESH_PROCESS, device.platform,
         *(str(tmp_path / name) for name in expected)],
        capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert run.returncode == 0, run.stderr
    for name, want in expected.items():
        got = np.load(tmp_path / f"{name}.out.npz")
        assert len(got.files) == len(want)
        for i, w in enumerate(want):
            w = np.asarray(w, np.float32)
            if device.platform == "cpu" or name != "grad":
                # The same program on the same inputs: identical results (jaxfuse's kernels
                # are deterministic).
                np.testing.assert_array_equal(got[f"arr_{i}"], w, err_msg=f"{name} output {i}")
            else:
                # The backward pass is XLA's convolutions, whose cuDNN algorithm (TF32 or not,
                # summation order) may be picked differently by another process.
                err = relative_error(got[f"arr_{i}"], w.astype(np.float64))
                assert err <= TOLERANCE[np.dtype(np.float32)], f"{name} output {i}: {err:.2e}"


def test_export_names_the_custom_call_without_the_disabled_check() -> None:
    with pytest.raises(ValueError, match="custom calls"):
        jax.export.export(jax.jit(_layer))(*_inputs("float32"))


def test_one_artifact_for_cpu_and_gpu() -> None:
    # The lowering is the same FFI call on every platform, so one export serves both.
    args = _inputs("float16")
    exported = jax.export.export(jax.jit(_layer), platforms=("cpu", "cuda"),
                                 disabled_checks=jf.export_disabled_checks())(*args)
    assert exported.platforms == ("cpu", "cuda")
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(*args), np.float32),
                                  np.asarray(jax.jit(_layer)(*args), np.float32))
