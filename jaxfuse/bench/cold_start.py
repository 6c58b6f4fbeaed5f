"""``python -m jaxfuse.bench.cold_start``: how long a model's first call takes, cold, under plain
``jax.jit`` and under ``jax.jit(fuse(apply))`` in each solver mode: the wait before a user's
first result.

Each (model, dtype, batch, program) runs in a process of its own with an empty kernel cache
(``JAXFUSE_CACHE_DIR``), so nothing is warm that a user's first run would not have warm: not
jaxfuse's kernels and decisions, not XLA's autotuning results. The first call traces,
compiles (every plan: runtime compiles, autotuning and, in auto mode, the measured choice)
and runs once. ``auto - fused`` is what the selection adds to the program's start, spread
over its distinct plans; ``auto - plain`` is what the user waits beyond plain ``jax.jit``.
Per plan, the selection's steps are ``python -m jaxfuse.bench.selection``'s.

A "model" may also be one layer of the benchmark suites, ``LAYER/LAYOUT`` (its chain as a user
writes it in jax, :meth:`~jaxfuse.bench.cases.BenchCase.unfused`, which ``fuse`` finds): a
program of one distinct signature, whose ``auto - plain`` is what that signature's first call
waits beyond plain ``jax.jit``: the fused kernel's compile and the choice, less the XLA compile
(cuDNN's autotuning included) that plain ``jax.jit`` does for the same convolution.

    python -m jaxfuse.bench.cold_start --model mobilenetv2-independent --dtype float32 \\
        --batch 256
    python -m jaxfuse.bench.cold_start --model mb2_dw_7_960/NHWC --dtype bfloat16 --batch 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROGRAMS = ("plain", "auto", "fused")


def child(model_name: str, dtype: str, batch: int, program: str) -> dict[str, Any]:
    """The first call's seconds of `program` for one model, in this (fresh) process."""
    import jax  # (here: the parent process does not start a backend)

    from .. import compiled, fuse
    from .cases import BenchCase
    from .end_to_end import model_inputs, place

    cache = Path(os.environ.get("JAXFUSE_CACHE_DIR", ""))
    entries = sum(1 for _ in cache.rglob("*")) if cache.is_dir() else 0
    device = jax.devices()[0]
    if "/" in model_name:  # one layer's chain
        layer, layout = model_name.split("/")
        case = BenchCase.for_layer(layer, batch, dtype, layout, "CBNA")
        apply, args = case.unfused(), case.arg_sets(1, device)[0]
    else:
        model, variables, x = model_inputs(model_name, dtype, batch)
        x, variables = place(x, variables, [device])
        apply, args = model.apply, (variables, x)
    jax.block_until_ready(args)  # (the backend is up: not the program's start)
    fn = jax.jit(apply if program == "plain" else fuse(apply, solver=program))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return {"model": model_name, "dtype": dtype, "batch": batch, "program": program,
            "device": device.device_kind, "first_call_s": first,
            "second_call_s": time.perf_counter() - start,
            "plans": compiled.cache_info()["compilations"], "cache_entries_at_start": entries}


def measure(model_name: str, dtype: str, batch: int, program: str,
            timeout: float) -> dict[str, Any]:
    """:func:`child` in a new process with an empty kernel cache of its own."""
    with tempfile.TemporaryDirectory(prefix="jaxfuse-cold-") as cache:
        env = {**os.environ, "JAXFUSE_CACHE_DIR": cache}
        # -P: not the working directory first on sys.path, which from a checkout is the source
        # folder, without the extension when the package was installed (as compile_time does)
        command = [sys.executable, "-P", "-m", "jaxfuse.bench.cold_start", "--child",
                   model_name, dtype, str(batch), program]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench.cold_start",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "DTYPE", "BATCH", "PROGRAM"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", nargs="+", default=["mobilenetv2-independent"],
                        help="models of python -m jaxfuse.bench.end_to_end, or LAYER/LAYOUT: "
                             "one layer of the benchmark suites")
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--batch", nargs="+", type=int, default=[256])
    parser.add_argument("--program", nargs="+", default=list(PROGRAMS), choices=PROGRAMS,
                        help="plain: jax.jit(apply); auto, fused: jax.jit(fuse(apply)) "
                             "in that solver mode")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one program's process may take")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.child:
        model_name, dtype, batch, program = args.child
        print(json.dumps(child(model_name, dtype, int(batch), program)), flush=True)
        return 0
    print(f"{'model':<25} {'dtype':<9} {'N':>4} "
          + " ".join(f"{p + ' s':>9}" for p in args.program)
          + f" {'plans':>5} {'sel/plan':>8} {'vs plain':>8}", flush=True)
    rows = []
    for model_name in args.model:
        for dtype in args.dtype:
            for batch in args.batch:
                row: dict[str, Any] = {"model": model_name, "dtype": dtype, "batch": batch}
                for program in args.program:
                    result = measure(model_name, dtype, batch, program, args.timeout)
                    row[program] = result
                rows.append(row)
                print(_line(row, args.program), flush=True)
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


def _line(row: dict[str, Any], programs: list[str]) -> str:
    """One row: each program's first call, and the selection's cost per plan (auto - fused)
    and the wait beyond plain jax.jit (auto - plain), where measured."""
    first = {p: row[p].get("first_call_s") for p in programs}
    cells = [f"{row['model']:<25} {row['dtype']:<9} {row['batch']:>4}"]
    cells += [f"{first[p]:9.2f}" if first[p] is not None else f"{'ERROR':>9}" for p in programs]
    plans = row.get("auto", {}).get("plans") or row.get("fused", {}).get("plans")
    cells.append(f"{plans or 0:>5}")
    per_plan = (f"{(first['auto'] - first['fused']) / plans:8.2f}"
                if plans and first.get("auto") is not None and first.get("fused") is not None
                else f"{'':>8}")
    versus = (f"{first['auto'] - first['plain']:+8.2f}"
              if first.get("auto") is not None and first.get("plain") is not None
              else f"{'':>8}")
    line = " ".join(cells) + f" {per_plan} {versus}"
    errors = [f"{p}: {row[p]['error']}" for p in programs if "error" in row[p]]
    return line + ("\n  " + "\n  ".join(errors) if errors else "")


if __name__ == "__main__":
    sys.exit(main())
