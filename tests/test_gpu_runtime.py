"""The GPU backend's runtime machinery on a real device (marked gpu; skipped without one):
kernels compiled once and reused from the disk cache by a second process, CUDA graphs, and
`python -m jaxfuse info` listing what was compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

# A child process compiles one plan and reports the backend's counters.
_CHILD = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case
    import jaxfuse as jf
    from jaxfuse._extension import extension
    err = run_case(Case(ops="CBNA", c=16, k=24, h=12, w=12, layout="NHWC",
                        filter_layout="HWIO", dtype="float16"), jax.devices("gpu")[0])
    print(json.dumps({{"stats": extension().gpu_stats(), "error": err}}))
""")


def _child(cache_dir: str, extra_env: dict[str, str] | None = None) -> dict:
    # Exact compile counts: one plan, one variant (autotuning has its own test).
    env = {**os.environ, "JAXFUSE_CACHE_DIR": cache_dir, "JAXFUSE_AUTOTUNE": "0",
           **(extra_env or {})}
    code = _CHILD.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_ok_child(template: str, cache_dir: str, **env_vars: str) -> str:
    """Runs a child script (`template`, formatted with the tests' folder) with its own kernel
    cache and `env_vars`; it must exit 0 and print "ok". Returns what it printed."""
    env = {**os.environ, "JAXFUSE_CACHE_DIR": cache_dir, **env_vars}
    done = subprocess.run([sys.executable, "-P", "-c",
                           template.format(tests=os.path.dirname(__file__))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-4000:]
    return done.stdout


def test_second_process_reuses_the_disk_cache(tmp_path) -> None:
    first = _child(str(tmp_path))
    assert first["stats"]["compilations"] == 1 and first["stats"]["disk_hits"] == 0
    second = _child(str(tmp_path))
    assert second["stats"]["compilations"] == 0 and second["stats"]["disk_hits"] == 1


def test_memory_only_cache(tmp_path) -> None:
    stats = _child("")["stats"]
    assert stats["compilations"] == 1 and stats["disk_hits"] == 0


def test_corrupted_cache_file_is_rebuilt(tmp_path) -> None:
    _child(str(tmp_path))
    (entry,) = list((tmp_path / "kernels").glob("*.jfk"))
    entry.write_bytes(entry.read_bytes()[:-100])  # truncated
    stats = _child(str(tmp_path))["stats"]
    assert stats["compilations"] == 1 and stats["disk_hits"] == 0
    assert _child(str(tmp_path))["stats"]["disk_hits"] == 1


def test_autotuning_runs_once_and_is_remembered(tmp_path) -> None:
    first = _child(str(tmp_path), {"JAXFUSE_AUTOTUNE": "1"})["stats"]
    assert first["tunings"] == 1 and first["compilations"] >= 2  # every variant compiled
    second = _child(str(tmp_path), {"JAXFUSE_AUTOTUNE": "1"})["stats"]
    assert second["tunings"] == 0 and second["compilations"] == 0
    assert second["disk_hits"] == 1  # the tuned choice came from disk too: nothing was timed


# Autotuning a plan whose filters are float32 (its timing runs allocate them as the plan reads
# them: they were once allocated in the plan's 16-bit dtype, and the kernels read past them).
_WIDE_TUNING_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case
    NHWC = dict(layout="NHWC", filter_layout="HWIO", filter_dtype="float32")
    for case in [Case(ops="CBNA", c=512, k=512, n=1, h=7, w=7, dtype="bfloat16", **NHWC),
                 Case(ops="CBNA", c=64, k=256, n=1, h=56, w=56, r=1, s=1, strides=(2, 2),
                      padding="VALID", dtype="float16", **NHWC)]:
        run_case(case, jax.devices("gpu")[0], solver="fused")
    print("ok")
""")


def test_autotuning_plans_with_float32_filters(tmp_path) -> None:
    _run_ok_child(_WIDE_TUNING_CHILD, str(tmp_path), JAXFUSE_AUTOTUNE="1")


# Shapes whose variants include every kind of tile (wide, deep, split-K over a cluster) and
# partial tiles; each variant is forced in turn, so none is only trusted to autotuning.
_VARIANTS_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case
    NHWC = dict(layout="NHWC", filter_layout="HWIO")
    NCHW = dict(layout="NCHW", filter_layout="OIHW")
    for case in [Case(ops="CBNSA", c=256, k=128, n=1, h=7, w=7, dtype="float16", **NHWC),
                 # The side input beside 256-wide tiles (loaded per chunk) and narrower ones
                 # (loaded a slice ahead), and in fp32 (TF32 kernel: two words a chunk).
                 Case(ops="CBNSA", c=128, k=512, n=8, h=28, w=28, r=1, s=1, padding="VALID",
                      dtype="bfloat16", **NHWC),
                 Case(ops="CBNSA", c=64, k=72, n=2, h=9, w=11, dtype="float32", **NHWC),
                 # fp32 on the Hopper wgmma kernel (TF32): HWIO filters transposed as they
                 # load (wide and narrow tiles), K-major OHWI ones (split-K at this size).
                 Case(ops="CBNA", c=128, k=256, n=8, h=14, w=14, dtype="float32", **NHWC),
                 Case(ops="CBA", c=64, k=128, n=1, h=7, w=7, r=1, s=1, padding="VALID",
                      dtype="float32", layout="NHWC", filter_layout="OHWI"),
                 Case(ops="CBNA", c=64, k=256, n=4, h=20, w=20, dtype="bfloat16", **NHWC),
                 Case(ops="CBA", c=512, k=64, n=2, h=5, w=5, r=1, s=1, padding="VALID",
                      dtype="float16", layout="NHWC", filter_layout="OHWI"),
                 # A one-k-tile reduction on the mma.sync kernel (MobileNet's 1x1 32->16),
                 # partial tiles.
                 Case(ops="CBN", c=32, k=16, n=8, h=29, w=27, r=1, s=1, padding="VALID",
                      dtype="bfloat16", **NHWC),
                 Case(ops="CNA", c=3, k=64, n=2, h=19, w=19, r=7, s=7, strides=(2, 2),
                      padding="SAME", dtype="float16", **NHWC),
                 # The stem kernel's tiles (rows of an even count of values).
                 Case(ops="CBNSA", c=3, k=64, n=2, h=20, w=20, r=7, s=7, strides=(2, 2),
                      padding="SAME", dtype="bfloat16", **NHWC),
                 # NCHW: gathered A, plane-by-plane epilogue (split-K included), B gathered
                 Case(ops="CBNSA", c=256, k=128, n=1, h=7, w=7, dtype="float16", **NCHW),
                 Case(ops="CBNA", c=64, k=256, n=4, h=20, w=20, dtype="bfloat16", **NCHW),
                 Case(ops="CNA", c=3, k=64, n=2, h=19, w=19, r=7, s=7, strides=(2, 2),
                      padding="SAME", dtype="float16", **NCHW),
                 # fp32 (TF32) with few channels: the gathered reduction (the 3-channel
                 # stem; B gathered too with OIHW filters), MobileNet's 24-channel 1x1.
                 Case(ops="CBNA", c=3, k=64, n=2, h=19, w=21, r=7, s=7, strides=(2, 2),
                      padding=((3, 3), (3, 3)), dtype="float32", **NHWC),
                 Case(ops="CNSA", c=3, k=64, n=2, h=19, w=19, r=7, s=7, strides=(2, 2),
                      padding="SAME", dtype="float32", **NCHW),
                 Case(ops="CBNA", c=24, k=144, n=4, h=14, w=14, r=1, s=1, padding="VALID",
                      activation="clipped_relu", dtype="float32", **NHWC),
                 # NHWC taps of whole 16-byte chunks, not whole k-tiles: chunk-by-chunk copies
                 # across taps and the reduction's zero-filled end, each filter layout.
                 Case(ops="CBNSA", c=24, k=144, n=4, h=15, w=13, r=1, s=1, padding="VALID",
                      dtype="bfloat16", **NHWC),
                 Case(ops="CBNA", c=24, k=40, n=2, h=11, w=9, r=1, s=1, padding="VALID",
                      dtype="float16", layout="NHWC", filter_layout="OHWI"),
                 Case(ops="CBNA", c=8, k=64, n=2, h=12, w=10, strides=(2, 1), padding="SAME",
                      dtype="bfloat16", **NHWC),
                 Case(ops="CNA", c=40, k=32, n=2, h=9, w=9, dilation=(2, 1), dtype="float16",
                      layout="NHWC", filter_layout="OHWI"),
                 Case(ops="CBNA", c=12, k=48, n=2, h=10, w=11, padding=((2, 0), (1, 1)),
                      dtype="float32", **NHWC),
                 # <= 32 output channels: the narrow tiles (128x16, 128x32), NCHW too.
                 Case(ops="CBNA", c=16, k=24, n=4, h=15, w=13, dtype="float32", **NHWC),
                 Case(ops="CBNSA", c=32, k=24, n=4, h=13, w=15, r=1, s=1, padding="VALID",
                      dtype="float16", **NCHW),
                 # Depthwise (tiled kernel): partial tiles, stride 2, a side input, several
                 # channel slices, per-activation batch norm, each dtype.
                 Case(ops="CBNSA", c=144, k=144, groups=144, n=4, h=28, w=28,
                      dtype="float16", **NHWC),
                 Case(ops="CBNA", c=96, k=96, groups=96, n=2, h=57, w=43, strides=(2, 2),
                      activation="clipped_relu", dtype="bfloat16", **NHWC),
                 Case(ops="CNA", c=40, k=40, groups=40, n=3, h=15, w=13,
                      bn_mode="per_activation", dtype="float32", **NHWC),
                 # MobileNet layers at batch 16 and 8: the tilings batch 64 takes.
                 Case(ops="CBNA", c=256, k=256, groups=256, n=16, h=28, w=28,
                      dtype="float16", **NHWC),
                 Case(ops="CBNA", c=96, k=96, groups=96, n=8, h=112, w=112, strides=(2, 2),
                      activation="clipped_relu", dtype="bfloat16", **NHWC),
                 # 64 output channels, [kk][k] filters: variants 5 and 6 are conv_tma's tiles
                 # with the operands swapped (256 and 128 pixels), a partial last tile.
                 Case(ops="CBNSA", c=64, k=64, n=3, h=17, w=19, dtype="bfloat16", **NHWC),
                 # float32 filters of 16-bit plans (a model's parameters): conv_wgmma's
                 # converting B path at batch 1 (split-K) and 4, OHWI, a side input; NCHW
                 # takes the direct kernel.
                 Case(ops="CBNA", c=512, k=512, n=1, h=7, w=7, dtype="bfloat16",
                      filter_dtype="float32", **NHWC),
                 Case(ops="CBNSA", c=128, k=200, n=4, h=9, w=11, strides=(2, 1),
                      dtype="float16", filter_dtype="float32", **NHWC),
                 Case(ops="CBA", c=64, k=72, n=1, h=14, w=14, r=1, s=1, padding="VALID",
                      dtype="bfloat16", layout="NHWC", filter_layout="OHWI",
                      filter_dtype="float32"),
                 Case(ops="CBNA", c=16, k=24, n=2, h=9, w=8, dtype="float16",
                      filter_dtype="float32", **NCHW),
                 # Batch 1, a long reduction: split-K with a ring that holds a CTA's whole
                 # share in flight (variant 3: 11 stages), a side input.
                 Case(ops="CBNSA", c=512, k=128, n=1, h=7, w=7, dtype="bfloat16", **NHWC),
                 # Pointwise plans small enough for one vector a thread: variant 0 a block
                 # table of channel terms, 1 each thread's own (16-byte loads); 2 and 3 the
                 # same with 8-byte vectors (16-bit dtypes).
                 Case(ops="BNA", c=64, n=1, h=12, w=12, dtype="bfloat16", layout="NHWC"),
                 Case(ops="NSA", c=256, n=1, h=14, w=14, dtype="float16", layout="NHWC"),
                 Case(ops="BNA", c=32, n=2, h=9, w=9, activation="elu", dtype="float32",
                      layout="NHWC"),
                 # ... and NCHW, which keep one channel a vector (8-byte vectors, then each
                 # thread's own terms) for planes of 4k values (10x6), not for others (5x7).
                 Case(ops="BNA", c=24, n=1, h=10, w=6, dtype="float16", layout="NCHW"),
                 Case(ops="NSA", c=16, n=1, h=5, w=7, dtype="bfloat16", layout="NCHW"),
                 # Elements past the last whole vector, and NHWC channels in whole 8-byte
                 # vectors but not 16-byte ones (12) or in neither (6).
                 Case(ops="BNA", c=6, n=1, h=5, w=5, dtype="float16", layout="NHWC"),
                 Case(ops="BNSA", c=12, n=1, h=7, w=5, dtype="float16", layout="NHWC"),
                 Case(ops="NA", c=3, n=1, h=5, w=7, dtype="bfloat16", layout="NCHW")]:
        run_case(case, jax.devices("gpu")[0])
    print("ok")
""")


# Every variant index a solver offers (8: the cp.async and TMA Hopper kernels' tiles; the
# depthwise solver's last is its vector kernel); indices past a plan's count clamp to its last.
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4, 5, 6, 7])
def test_every_kernel_variant_is_correct(tmp_path, variant: int) -> None:
    _run_ok_child(_VARIANTS_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT=str(variant))


def test_under_cuda_graphs(tmp_path) -> None:
    flags = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
             "--xla_gpu_graph_min_graph_size=1")
    out = _child(str(tmp_path), {"XLA_FLAGS": flags})
    assert out["error"] < 1e-2


# Two fused chains with one of XLA's ops between them, called with new inputs each time while
# every earlier output stays alive, so each call's buffers sit at new addresses and XLA updates
# its command buffer: where the record stage is registered, by updating the kernels' nodes.
_RECORDED_CHILD = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse as jf
    from jaxfuse._extension import extension, record_target

    def layer(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + b)

    def net(x, w1, b1, w2, b2, w3, b3):
        return layer(layer(layer(x, w1, b1) * 0.5, w2, b2), w3, b3)

    rng = np.random.default_rng(0)
    def rand(*shape):
        return jnp.asarray(rng.uniform(-1, 1, shape), jnp.float16)
    params = (rand(3, 3, 16, 32) * 0.2, rand(32), rand(3, 3, 32, 24) * 0.2, rand(24),
              rand(3, 3, 24, 24) * 0.2, rand(24))
    fused, plain = jax.jit(jf.fuse(net, solver="fused")), jax.jit(net)
    hlo = fused.lower(rand(2, 12, 12, 16), *params).as_text()
    outs, refs = [], []
    for _ in range(6):
        x = rand(2, 12, 12, 16)
        outs.append(fused(x, *params))
        refs.append(plain(x, *params))
    error = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))) /
                      jnp.max(jnp.abs(r.astype(jnp.float32)))) for o, r in zip(outs, refs))
    stats = extension().gpu_stats()
    print(json.dumps({"target": record_target(), "records": stats["records"],
                      "updates": stats["record_updates"], "error": error,
                      "pdl": "uses_pdl = true" in hlo,
                      "built_with_record": hasattr(extension(), "register_cuda_record")}))
""")


# With XLA's default flags a program this small may stay out of command buffers; with a
# minimum graph size of 1 the fused calls are in one, the last two with programmatic edges
# between them (each kernel may start before the previous one ends), or without
# (JAXFUSE_PDL=0); with command buffers off the execute stage loads each kernel itself (the
# record-stage bundle has no initialize stage).
@pytest.mark.parametrize("mode", ["default", "graphs", "graphs without pdl", "off"])
def test_recorded_launches_follow_moving_buffers(tmp_path, mode: str) -> None:
    graphs = mode.startswith("graphs")
    flags = {"default": "", "off": "--xla_gpu_enable_command_buffer=",
             "graphs": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                       "--xla_gpu_graph_min_graph_size=1"}[mode.split()[0]]
    # (Poisoned outputs take a memset before each launch, which XLA captures instead; here
    # every output is compared with XLA's, and a stale buffer would not match.)
    env = {**os.environ, "JAXFUSE_CACHE_DIR": str(tmp_path), "XLA_FLAGS": flags,
           "JAXFUSE_POISON_OUTPUTS": "0", "JAXFUSE_PDL": "0" if "without" in mode else "1"}
    done = subprocess.run([sys.executable, "-P", "-c", _RECORDED_CHILD], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["error"] < 1e-2, out
    if out["built_with_record"]:  # (jax >= 0.11 headers: the build has the record stage)
        assert out["target"] is not None, out  # registered past jaxlib (_extension.py)
        assert out["pdl"] == ("without" not in mode), out
        if graphs:
            assert out["records"] >= 2 and out["updates"] >= 2, out


def test_info_lists_compiled_kernels(tmp_path) -> None:
    _child(str(tmp_path))
    env = {**os.environ, "JAXFUSE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-P", "-m", "jaxfuse", "info"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 compiled kernel(s)" in done.stdout
    assert "CBNA" in done.stdout and "nvrtc" in done.stdout


# The warp-specialized kernel (bulk tensor copies, im2col maps) forced on every geometry its
# maps must express: strides, asymmetric and negative padding, dilation, groups, partial tiles
# in both dimensions, each filter layout it reads, side input, per-activation batch norm.
_TMA_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_forced_cases
    gpu = jax.devices("gpu")[0]
    NHWC = dict(layout="NHWC", filter_layout="HWIO")
    cases = [
        Case(ops="CBNA", c=64, k=256, n=8, h=28, w=28, r=1, s=1, padding="VALID",
             dtype="bfloat16", **NHWC),
        Case(ops="CBNSA", c=128, k=128, n=3, h=15, w=13, dtype="float16", **NHWC),
        Case(ops="CNA", c=64, k=72, n=2, h=17, w=11, strides=(2, 2), padding="SAME",
             dtype="bfloat16", **NHWC),
        Case(ops="CBA", c=64, k=64, n=2, h=12, w=14, padding=((0, 2), (1, 0)),
             dilation=(2, 3), dtype="float16", **NHWC),
        Case(ops="CBA", c=128, k=64, n=2, h=10, w=10, padding=((-1, 1), (0, 0)),
             dtype="bfloat16", **NHWC),
        Case(ops="CBNA", c=128, k=96, n=2, h=9, w=9, groups=2, dtype="float16", **NHWC),
        Case(ops="CNA", c=64, k=320, n=1, h=7, w=7, bn_mode="per_activation",
             dtype="bfloat16", **NHWC),
        Case(ops="CBNSA", c=256, k=128, n=4, h=7, w=7, strides=(1, 2), dtype="bfloat16",
             layout="NHWC", filter_layout="OHWI"),
        Case(ops="CBA", c=512, k=64, n=2, h=5, w=5, r=1, s=1, padding="VALID",
             dtype="float16", layout="NHWC", filter_layout="OIHW"),
        Case(ops="CBNA", c=64, k=64, n=16, h=56, w=56, dtype="bfloat16", **NHWC),
        # fp32 through TF32: HWIO filters transposed by the producer warpgroup, OHWI ones
        # through the copy engine.
        Case(ops="CBNA", c=64, k=128, n=4, h=14, w=14, dtype="float32", **NHWC),
        Case(ops="CBNSA", c=96, k=72, n=3, h=9, w=11, strides=(2, 1), padding="SAME",
             dtype="float32", **NHWC),
        Case(ops="CBNA", c=64, k=64, n=2, h=10, w=10, groups=2, dilation=(2, 1),
             dtype="float32", **NHWC),
        Case(ops="CNSA", c=128, k=256, n=2, h=7, w=7, r=1, s=1, padding="VALID",
             dtype="float32", layout="NHWC", filter_layout="OHWI"),
        Case(ops="CBA", c=64, k=96, n=2, h=8, w=8, dtype="float32", layout="NHWC",
             filter_layout="OHWI"),
    ]
    run_forced_cases(cases, gpu, lambda info: info["solver"] == "conv_tma")
    # fp32 with HWIO filters transposed in the kernel over several tiles per persistent block
    # (a stage's arrival carried from one tile into the next, the drain after the last).
    # Outputs this large take the transposed-filter form, switched off here.
    import jaxfuse.solvers
    jaxfuse.solvers.kernel_filters = lambda signature, device: None
    run_forced_cases(
        [Case(ops="CBNA", c=64, k=128, n=8, h=56, w=56, dtype="float32", **NHWC),
         Case(ops="CBA", c=32, k=64, n=8, h=56, w=56, r=1, s=1, padding="VALID",
              dtype="float32", **NHWC),
         Case(ops="CBNSA", c=64, k=144, n=8, h=28, w=28, groups=2, dtype="float32", **NHWC)],
        gpu, lambda info: info["solver"] == "conv_tma" and "filters" not in info)
    print("ok")
""")


# The warp-specialized kernel's ping-pong schedule (each consumer warpgroup its own tiles, in
# turn) forced on blocks of two and more tiles, odd tile counts, partial tiles, each filter
# form (TF32's transposed B included) and a side input.
_PINGPONG_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_forced_cases
    import jaxfuse.solvers
    gpu = jax.devices("gpu")[0]
    NHWC = dict(layout="NHWC", filter_layout="HWIO")
    # Every plan in its own filter form (fp32 HWIO: B transposed in the kernel).
    jaxfuse.solvers.kernel_filters = lambda signature, device: None
    run_forced_cases([
        Case(ops="CBNA", c=64, k=128, n=16, h=56, w=56, dtype="bfloat16", **NHWC),
        Case(ops="CBNSA", c=256, k=96, n=12, h=27, w=29, r=1, s=1, padding="VALID",
             dtype="float16", layout="NHWC", filter_layout="OHWI"),
        Case(ops="CNA", c=128, k=128, n=9, h=30, w=30, strides=(2, 2), padding="SAME",
             bn_mode="per_activation", dtype="bfloat16", **NHWC),
        Case(ops="CBNA", c=64, k=64, n=16, h=28, w=28, dtype="float32", **NHWC),
        Case(ops="CBNSA", c=64, k=128, n=8, h=28, w=28, r=1, s=1, padding="VALID",
             dtype="float32", layout="NHWC", filter_layout="OHWI"),
        Case(ops="CBA", c=128, k=64, n=1, h=7, w=7, dtype="float16", **NHWC),
    ], gpu, lambda info: info["solver"] == "conv_tma" and info.get("tile", "").endswith(" pp"))
    print("ok")
""")


def test_the_ping_pong_schedule_is_correct(tmp_path) -> None:
    _run_ok_child(_PINGPONG_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT="conv_tma pp")


# The few-channel stem kernel forced: ResNet's 7x7/2 and MobileNet's 3x3/2 stems (tiles that
# end inside an output row, rows shorter than a tile), 1, 2 and 4 channels, each filter layout,
# 8 to 128 output channels, a side input, per-activation batch norm, strides along W of 1 to 4,
# asymmetric padding; and infinities in the input, which must not meet the zeros that pad the
# reduction (inf * 0 would be NaN where the reference has inf).
_STEM_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case_with_infinities, run_forced_cases
    gpu = jax.devices("gpu")[0]
    cases = [
        Case(ops="CBNA", c=3, k=64, n=2, h=30, w=30, r=7, s=7, strides=(2, 2),
             padding=((3, 3), (3, 3)), dtype="bfloat16", layout="NHWC", filter_layout="HWIO"),
        Case(ops="CBNA", c=3, k=64, n=2, h=160, w=160, r=7, s=7, strides=(2, 2),
             padding=((3, 3), (3, 3)), dtype="float16", layout="NHWC", filter_layout="HWIO"),
        Case(ops="CBNA", c=3, k=32, n=3, h=66, w=66, strides=(2, 2), padding="SAME",
             activation="clipped_relu", dtype="bfloat16", layout="NHWC", filter_layout="HWIO"),
        Case(ops="CBNSA", c=3, k=24, n=2, h=17, w=18, r=5, s=5, padding=((2, 2), (1, 3)),
             bn_mode="per_activation", dtype="float16", layout="NHWC", filter_layout="OHWI"),
        Case(ops="CNA", c=4, k=128, n=2, h=13, w=20, strides=(2, 1), padding="SAME",
             dtype="bfloat16", layout="NHWC", filter_layout="OIHW"),
        Case(ops="CBA", c=1, k=8, n=2, h=28, w=28, padding="SAME", dtype="float16",
             layout="NHWC", filter_layout="HWIO"),
        Case(ops="CBNA", c=2, k=40, n=1, h=9, w=33, r=1, s=9, strides=(1, 4),
             padding=((0, 0), (4, 4)), dtype="bfloat16", layout="NHWC", filter_layout="OHWI"),
    ]
    run_forced_cases(cases, gpu, lambda info: info["solver"] == "conv_stem")
    run_case_with_infinities(cases[0], gpu)
    print("ok")
""")


# Its first variant (the staged epilogue) and its first register-epilogue one.
@pytest.mark.parametrize("forced", ["conv_stem", "conv_stem r"])
def test_the_stem_kernel_is_correct(tmp_path, forced: str) -> None:
    _run_ok_child(_STEM_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT=forced)


# The depthwise kernel walking several tiles a CTA (the next window copied while this one is
# computed), forced: its tables built once, the windows alternating, the last CTA's shorter walk.
_WALK_CHILD = textwrap.dedent("""
    import os
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import WALKING_DEPTHWISE_CASES, run_forced_cases
    walk = os.environ["JAXFUSE_KERNEL_VARIANT"].split()[-1]
    run_forced_cases(WALKING_DEPTHWISE_CASES, jax.devices("gpu")[0],
                     lambda info: info["tile"].endswith(walk))
    print("ok")
""")


@pytest.mark.parametrize("walk", ["walk2", "walk4"])
def test_the_walking_depthwise_kernel_is_correct(tmp_path, walk: str) -> None:
    _run_ok_child(_WALK_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT=f"conv_depthwise {walk}")


# The planar depthwise kernel (NCHW), forced (its default tiling, and its tall one where the
# planes have one; elsewhere the default again): the edge geometries in every dtype and filter
# layout (odd channel counts, strides, uneven and negative padding, dilation, 9x9 filters, a
# side input, per-activation batch norm) and MobileNet's depthwise layers at batch 4, where
# autotuning could keep conv_direct instead.
_PLANES_CHILD = textwrap.dedent("""
    import dataclasses
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import PLANAR_DEPTHWISE_CASES, layer_case, run_forced_cases, suite_layers
    cases = [dataclasses.replace(c, dtype=d) for c in PLANAR_DEPTHWISE_CASES
             if c.r * c.s <= 81 for d in ("float32", "float16", "bfloat16")]
    cases += [layer_case(layer, dtype="bfloat16", layout="NCHW", n=4)
              for layer in suite_layers("mobilenet", "mobilenetv2", depthwise=True)]
    run_forced_cases(cases, jax.devices("gpu")[0], lambda info: info["solver"] == "conv_planes")
    print("ok")
""")


@pytest.mark.parametrize("tiling", ["conv_planes", "conv_planes b8", "conv_planes b4 c2",
                                    "conv_planes b8 c2"])
def test_the_planar_depthwise_kernel_is_correct(tmp_path, tiling: str) -> None:
    _run_ok_child(_PLANES_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT=tiling)


# On sm_90 the tiled depthwise kernel copies its windows with the copy engine (the default
# tests run it); the cp.async form stays a candidate autotuning may keep: forced here, on the
# edge geometries (negative and uneven padding, dilation, strides) and the walking cases' shapes.
_CP_ASYNC_CHILD = textwrap.dedent("""
    import dataclasses
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import DEPTHWISE_CASES, WALKING_DEPTHWISE_CASES, run_forced_cases
    gpu = jax.devices("gpu")[0]
    if getattr(gpu, "compute_capability", "") != "9.0":  # (no twin elsewhere)
        print("ok")
        sys.exit(0)
    cases = [dataclasses.replace(c, dtype=d) for c in DEPTHWISE_CASES
             for d in ("bfloat16", "float32")] + WALKING_DEPTHWISE_CASES
    twins = []
    for case in cases:
        plan, _ = case.build()
        plan.compile(gpu, solver="fused")
        if plan.kernel_info["tile"].endswith("cp.async"):
            twins.append(case)
    assert len(twins) >= 8, len(twins)
    run_forced_cases(twins, gpu, lambda info: info["tile"].endswith("cp.async"))
    print("ok")
""")


def test_the_cp_async_depthwise_twin_is_correct(tmp_path) -> None:
    _run_ok_child(_CP_ASYNC_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT="conv_depthwise cp.async")


# conv_tma's tiles with the operands swapped (64 output channels a group, [kk][k] filters), the
# first of them forced (256 pixels a tile): partial tiles, stride, dilation, groups, 1x1, a
# side input, per-activation batch norm, both 16-bit dtypes, and infinities in the input.
_SWAP_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case_with_infinities, run_forced_cases
    gpu = jax.devices("gpu")[0]
    NHWC = dict(layout="NHWC", filter_layout="HWIO")
    cases = [
        Case(ops="CBNA", c=64, k=64, n=3, h=17, w=19, dtype="bfloat16", **NHWC),
        Case(ops="CBNSA", c=128, k=64, n=2, h=23, w=21, strides=(2, 2), padding="SAME",
             dtype="float16", **NHWC),
        Case(ops="CNA", c=256, k=64, n=4, h=14, w=14, r=1, s=1, padding="VALID",
             bn_mode="per_activation", dtype="bfloat16", **NHWC),
        Case(ops="CBA", c=128, k=128, n=2, h=9, w=11, groups=2, dilation=(2, 1),
             padding="SAME", activation="clipped_relu", dtype="float16", **NHWC),
        Case(ops="CBNA", c=64, k=64, n=16, h=56, w=56, dtype="bfloat16", **NHWC),
    ]
    run_forced_cases(cases, gpu, lambda info: info["tile"].endswith(" sw"))
    run_case_with_infinities(cases[0], gpu)
    print("ok")
""")


def test_the_swapped_operand_tiles_are_correct(tmp_path) -> None:
    _run_ok_child(_SWAP_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT="conv_tma sw")


# conv_tma's halo tiles (a tile's input window loaded once, each tap a view of it; stride 1,
# 64 -> 64 channels), forced: partial tiles in both directions, asymmetric, negative and no
# padding, 1x3 and 3x1 windows, a side input, per-activation batch norm, both 16-bit dtypes,
# a ResNet-50 layer's geometry, and infinities in the input.
_HALO_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case_with_infinities, run_forced_cases
    gpu = jax.devices("gpu")[0]
    NHWC = dict(layout="NHWC", filter_layout="HWIO", c=64, k=64)
    cases = [
        Case(ops="CBNA", n=3, h=17, w=19, dtype="bfloat16", **NHWC),
        Case(ops="CBNSA", n=2, h=40, w=24, dtype="float16", **NHWC),
        Case(ops="CBA", n=2, h=12, w=13, padding=((0, 2), (1, 0)), activation="clipped_relu",
             dtype="bfloat16", **NHWC),
        Case(ops="CNA", n=1, h=9, w=11, padding="VALID", bn_mode="per_activation",
             dtype="float16", **NHWC),
        Case(ops="CBNA", n=2, h=10, w=10, padding=((-1, 1), (1, 1)), dtype="bfloat16", **NHWC),
        Case(ops="CBNA", n=2, h=7, w=30, r=1, s=3, padding="SAME", dtype="float16", **NHWC),
        Case(ops="CBNSA", n=2, h=33, w=9, r=3, s=1, padding="SAME", dtype="bfloat16", **NHWC),
        Case(ops="CBNA", n=16, h=56, w=56, dtype="bfloat16", **NHWC),
        # 672 tiles: five or six a persistent block, so each consumer's stage is reused
        # (the second phase of every barrier).
        Case(ops="CBNA", n=48, h=56, w=56, dtype="float16", **NHWC),
    ]
    run_forced_cases(cases, gpu, lambda info: info["tile"].endswith(" halo"))
    run_case_with_infinities(cases[0], gpu)
    print("ok")
""")


def test_the_halo_tiles_are_correct(tmp_path) -> None:
    _run_ok_child(_HALO_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT="conv_tma halo")


# NCHW plans in their NHWC form (input transposed to NHWC, HWIO filters, the kernel writing
# NCHW planes: jaxfuse.solvers.kernel_forms), the form forced over the measured choice:
# partial tiles, stride 2, 1x1, 64 output channels (swapped tiles), a side input and
# per-activation batch norm in NCHW, both 16-bit dtypes, a stem (the stem kernel), and
# infinities in the input.
_FORM_CHILD_HEAD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case_with_infinities, run_forced_cases
    import jaxfuse.find
    jaxfuse.find.fastest_form = lambda signature, device, kernels, trial=None: kernels[-1]
    gpu = jax.devices("gpu")[0]
    NCHW = dict(layout="NCHW", filter_layout="OIHW")
""")
_NHWC_FORM_CHILD = _FORM_CHILD_HEAD + textwrap.dedent("""\
    cases = [
        Case(ops="CBNA", c=64, k=64, n=2, h=34, w=33, dtype="bfloat16", **NCHW),
        Case(ops="CBNSA", c=128, k=96, n=4, h=46, w=45, strides=(2, 2), padding="SAME",
             dtype="float16", **NCHW),
        Case(ops="CNA", c=256, k=64, n=8, h=17, w=17, r=1, s=1, padding="VALID",
             bn_mode="per_activation", dtype="bfloat16", **NCHW),
        Case(ops="CBNSA", c=64, k=128, n=3, h=30, w=31, bn_mode="per_activation",
             activation="clipped_relu", dtype="float16", **NCHW),
        Case(ops="CBNA", c=3, k=64, n=2, h=96, w=96, r=7, s=7, strides=(2, 2),
             padding=((3, 3), (3, 3)), dtype="float16", **NCHW),
        Case(ops="CBNSA", c=3, k=32, n=3, h=66, w=66, strides=(2, 2), padding="SAME",
             bn_mode="per_activation", dtype="bfloat16", **NCHW),
    ]
    run_forced_cases(cases, gpu, lambda info: (
        info.get("input_layout", "").startswith("NHWC")
        and info["solver"] in ("conv_tma", "conv_wgmma", "conv_stem")))
    run_case_with_infinities(cases[0], gpu)
    run_case_with_infinities(cases[4], gpu)
    print("ok")
""")


# Forced: conv_tma's first tile (conv_stem's staged one for the stems); its swapped tile for
# 64 channels (conv_wgmma's first tile for the rest); conv_stem's register epilogue.
@pytest.mark.parametrize("forced", ["conv_tma", "conv_tma sw", "conv_stem r"])
def test_the_nhwc_form_of_nchw_plans_is_correct(tmp_path, forced: str) -> None:
    _run_ok_child(_NHWC_FORM_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT=forced)


# fp32 NCHW plans in their TF32 NHWC form (on unless JAXFUSE_TF32_NCHW_FORM=0: K-major
# filters, OHWI or a 1x1 layer's own OIHW), forced as above: partial tiles, stride 2 with a
# side input, 1x1 with per-activation batch norm, clipped relu, and a batch-1 layer whose
# reduction is split across a cluster (the split-K epilogue's NCHW stores).
_TF32_FORM_CHILD = _FORM_CHILD_HEAD + textwrap.dedent("""\
    NCHW32 = dict(NCHW, dtype="float32")
    cases = [
        Case(ops="CBNA", c=64, k=64, n=2, h=34, w=33, **NCHW32),
        Case(ops="CBNSA", c=128, k=96, n=4, h=46, w=45, strides=(2, 2), padding="SAME",
             **NCHW32),
        Case(ops="CNA", c=256, k=64, n=8, h=17, w=17, r=1, s=1, padding="VALID",
             bn_mode="per_activation", **NCHW32),
        Case(ops="CBNSA", c=64, k=128, n=3, h=30, w=31, bn_mode="per_activation",
             activation="clipped_relu", **NCHW32),
        Case(ops="CBNSA", c=512, k=64, n=1, h=46, w=46, **NCHW32),
    ]
    run_forced_cases(cases, gpu, lambda info: (
        info.get("input_layout", "").startswith("NHWC")
        and info["solver"] in ("conv_tma", "conv_wgmma")))
    run_case_with_infinities(cases[0], gpu)
    print("ok")
""")


@pytest.mark.parametrize("forced", ["conv_tma", "conv_wgmma", "conv_wgmma k/4"])
def test_the_tf32_nhwc_form_of_fp32_nchw_plans_is_correct(tmp_path, forced: str) -> None:
    _run_ok_child(_TF32_FORM_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT=forced,
                  JAXFUSE_TF32_NCHW_FORM="1")


def test_the_warp_specialized_kernel_is_correct(tmp_path) -> None:
    _run_ok_child(_TMA_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT="conv_tma")


# Tensor maps hold their buffers' addresses (gpu/runtime.cc caches them by address): each call
# of a kernel that loads through the copy engine gets a new input (kept alive, so no address
# repeats), must have its maps encoded again, and must match the reference.
_MOVED_MAPS_CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    from cases import Case, relative_error
    from jaxfuse._extension import extension
    from jaxfuse.reference import reference_float64
    gpu = jax.devices("gpu")[0]
    NHWC = dict(layout="NHWC", filter_layout="HWIO")
    cases = [
        Case(ops="CBNA", c=64, k=64, n=1, h=14, w=14, dtype="bfloat16", **NHWC),
        Case(ops="CBA", c=128, k=64, n=2, h=10, w=10, strides=(2, 2), padding="SAME",
             dtype="float16", layout="NHWC", filter_layout="OHWI"),
        Case(ops="CBNSA", c=64, k=128, n=2, h=14, w=14, dtype="float32", **NHWC),
    ]
    rng = np.random.default_rng(0)
    before = extension().gpu_stats()
    for case in cases:
        plan, handles = case.build()
        plan.compile(gpu, solver="fused")
        assert plan.kernel_info["solver"] == "conv_tma", plan.kernel_info
        run = jax.jit(plan.execute)
        kept = []
        for _ in range(6):
            x, args, operands = case.random_args(plan, handles, rng)
            kept.append((run(*jax.device_put((x, args), gpu)), operands))
        for out, operands in kept:
            err = relative_error(out, reference_float64(plan.signature, *operands))
            assert err <= case.tolerance(gpu), (str(case), err)
    after = extension().gpu_stats()
    print(json.dumps({{"encodes": after["tensor_map_encodes"] - before["tensor_map_encodes"],
                      "calls": 6 * len(cases)}}))
    print("ok")
""")


def test_tensor_maps_follow_moving_buffers(tmp_path) -> None:
    out = _run_ok_child(_MOVED_MAPS_CHILD, str(tmp_path), JAXFUSE_KERNEL_VARIANT="conv_tma")
    counts = json.loads(out.strip().splitlines()[-2])
    assert counts["encodes"] >= counts["calls"], counts  # (the input's map, at least)
