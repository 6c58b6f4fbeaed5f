"""Compiled plans are memoized per (platform, device, signature); arguments never recompile."""

from __future__ import annotations

import jax
import numpy as np
from cases import Case

import jaxfuse as jf


def test_identical_plans_hit_the_cache(device) -> None:
    case = Case(ops="CBA", c=5, k=7)
    before = jf.cache_info()
    case.build()[0].compile(device)
    mid = jf.cache_info()
    case.build()[0].compile(device)
    after = jf.cache_info()
    assert mid["compilations"] <= before["compilations"] + 1
    assert after["compilations"] == mid["compilations"]
    assert after["hits"] == mid["hits"] + 1


def test_new_arguments_never_recompile(device) -> None:
    case = Case(ops="CBNA", c=6, k=6, activation="leaky_relu")
    plan, handles = case.build()
    plan.compile(device)
    rng = np.random.default_rng(0)
    run = jax.jit(plan.execute)
    outputs = []
    count = jf.cache_info()["compilations"]
    for _ in range(4):
        x, args, _ = case.random_args(plan, handles, rng)
        outputs.append(np.asarray(run(jax.device_put(x, device), jax.device_put(args, device))))
    assert jf.cache_info()["compilations"] == count
    assert run._cache_size() == 1  # one XLA program for every argument set
    assert not np.allclose(outputs[0], outputs[1])


def test_different_signatures_compile_separately(device) -> None:
    before = jf.cache_info()["compilations"]
    Case(ops="CA", c=3, k=5, h=6, w=6).build()[0].compile(device)
    Case(ops="CA", c=3, k=5, h=6, w=7).build()[0].compile(device)
    assert jf.cache_info()["compilations"] == before + 2
