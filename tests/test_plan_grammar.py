"""The plan string's grammar (csrc/common/plan_spec.cc) is strict, and no byte of a plan's text
reaches generated GPU source or a cache key: both use the canonical form re-serialized from the
parsed fields.

A plan arrives from untrusted places (an exported program), and the GPU backend turns it into
NVRTC source. These tests refuse every way a plan's text could carry something past the parser
(a repeated field whose first value is never validated, newlines, control characters, '#',
non-ASCII), check that two spellings of one plan are one canonical plan, and fuzz the parser in
a child process (`python -P`), so that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from cases import Case, compiler_available, edited_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxfuse._extension import extension

EXPLORE = os.environ.get("JAXFUSE_HYPOTHESIS") == "explore"
FIELD_ORDER = ("dtype", "layout", "in", "ops", "conv", "bn", "act")
GRAMMAR = re.compile(r"[A-Za-z0-9;=,\-_]*")


NVRTC = compiler_available("CUDA")

# Plans of every shape the parser knows: with and without a convolution, each dtype, layout,
# filter layout, batch-norm mode; negative padding and tf32 off.
PLANS = [Case(ops=ops, dtype=dt, layout=layout, filter_layout=fl, bn_mode=bn, padding=pad,
              activation=act).build()[0].signature.encode()
         for ops, dt, layout, fl, bn, pad, act in [
             ("CBNSA", "float32", "NCHW", "OIHW", "spatial", ((1, 1), (1, 1)), "relu"),
             ("CNA", "float16", "NHWC", "HWIO", "per_activation", ((0, -1), (2, 0)), "elu"),
             ("CA", "bfloat16", "NHWC", "OHWI", "spatial", "VALID", "clipped_relu"),
             ("BNSA", "float32", "NCHW", "OIHW", "spatial", "SAME", "tanh"),
             ("NA", "float16", "NHWC", "OIHW", "per_activation", "SAME", "power"),
             ("A", "float32", "NCHW", "OIHW", "spatial", "SAME", "leaky_relu")]]


def canonical_oracle(plan: str) -> str:
    """The canonical form of a plan the parser accepted, computed independently of it: fields in
    PlanSignature.encode()'s order, integers without leading zeros or signs of zero."""
    fields = dict(f.split("=", 1) for f in plan.split(";")[1:])

    def entries(value: str) -> str:
        return ",".join(str(int(e)) if re.fullmatch(r"-?\d+", e) else e for e in value.split(","))

    return ";".join(["jaxfuse1", *(f"{k}={entries(fields[k])}" for k in FIELD_ORDER
                                   if k in fields)])


# ----- the grammar ------------------------------------------------------------------------------

def _fields(plan: str) -> list[str]:
    return plan.split(";")


@pytest.mark.parametrize("plan", PLANS)
def test_python_encoding_is_canonical(plan: str) -> None:
    # Cache keys of every plan jaxfuse itself makes are the same as before canonicalization.
    assert extension().plan_canonical(plan) == plan


@pytest.mark.parametrize("position", ["before", "after"])
@pytest.mark.parametrize("plan", PLANS[:3])
def test_repeated_fields_are_refused(plan: str, position: str) -> None:
    ext = extension()
    fields = _fields(plan)
    for i in range(1, len(fields)):
        key = fields[i].split("=")[0]
        repeated = list(fields)
        repeated.insert(i if position == "before" else i + 1, fields[i])
        for text in (";".join(repeated),
                     # The repro's forgery: a first value that only the last one would hide.
                     ";".join(repeated).replace(fields[i], f"{key}=\n#error X\n", 1)):
            with pytest.raises(ValueError, match=f"'{key}'"):
                ext.cpu_prepare(text)
        with pytest.raises(ValueError, match=f"field '{key}' is repeated"):
            ext.cpu_prepare(";".join(repeated))


# Characters no plan has: line breaks, control characters, preprocessor and comment syntax,
# quotes, whitespace, non-ASCII (some of it a line break to a C++ compiler or an editor).
FOREIGN = ["\n", "\r", "\t", "\v", "\f", "\x00", "\x1b", "\x7f", "#", "/", "*", "\\", '"', "'",
           " ", "+", ".", ":", "(", "{", "<", "é", "\u2028", "\x85", "\U0001f600"]


@pytest.mark.parametrize("char", FOREIGN, ids=ascii)
@pytest.mark.parametrize("plan", [PLANS[0], PLANS[3]])
def test_characters_outside_the_grammar_are_refused(plan: str, char: str) -> None:
    ext = extension()
    fields = _fields(plan)
    for i in range(1, len(fields)):
        key, value = fields[i].split("=")
        for at in (0, len(value) // 2, len(value)):
            edited = list(fields)
            edited[i] = f"{key}={value[:at]}{char}{value[at:]}"
            with pytest.raises(ValueError,
                               match=f"'{key}' has a character outside the plan grammar"):
                ext.cpu_prepare(";".join(edited))
    for text in (char + plan, plan + char, plan.replace(";", char + ";", 1)):
        with pytest.raises(ValueError, match="character outside the plan grammar") as err:
            ext.cpu_prepare(text)
        assert str(err.value).isascii() and str(err.value).isprintable()


def test_the_issue_forgery_is_refused_by_every_entry_point() -> None:
    ext = extension()
    base = "jaxfuse1;dtype=f32;layout=NCHW;in=1,1,1,1;ops=A;act=3"
    forged = base.replace("act=3", "act=\n#error JF_INJECTED\n#define JF_TAIL ;act=3")
    for call in (lambda: ext.cpu_prepare(forged), lambda: ext.plan_canonical(forged),
                 lambda: ext.gpu_compile_only("CUDA", forged, "sm_90")):
        with pytest.raises(ValueError, match="'act' has a character outside the plan grammar"):
            call()


def test_overlong_plans_are_refused() -> None:
    plan = PLANS[0].replace("in=2,", "in=" + "0" * 2000 + "2,")
    with pytest.raises(ValueError, match="at most 1024"):
        extension().plan_canonical(plan)


@pytest.mark.parametrize("seed, plan", list(enumerate(PLANS)))
def test_spellings_of_one_plan_share_the_canonical_form(seed: int, plan: str) -> None:
    ext = extension()
    rng = np.random.default_rng(seed)
    fields = _fields(plan)
    for _ in range(8):
        body = [fields[0], *(fields[1:][i] for i in rng.permutation(len(fields) - 1))]
        # Leading zeros on some integers, "-0" for zero padding.
        spelled = re.sub(r"(?<=[=,])(\d+)(?=[,;]|$)",
                         lambda m: ("-0" if m[1] == "0" else "0" * int(rng.integers(1, 4)) + m[1])
                         if rng.random() < 0.5 else m[1], ";".join(body))
        assert ext.plan_canonical(spelled) == plan
        assert canonical_oracle(spelled) == plan


@pytest.mark.skipif(not NVRTC, reason="NVRTC is not installed")
@pytest.mark.parametrize("plan", PLANS)
def test_generated_source_depends_only_on_the_canonical_plan(plan: str) -> None:
    ext = extension()
    body = _fields(plan)
    spelled = ";".join([body[0], *reversed(body[1:])]).replace("=", "=00", 1)
    ours, theirs = (ext.gpu_compile_only("CUDA", p, "sm_90")["source"] for p in (plan, spelled))
    assert ours == theirs
    assert ours.splitlines()[0] == f"// jaxfuse kernel for plan: {plan}"
    assert spelled not in ours


# ----- fuzzing, in a child process --------------------------------------------------------------

# Runs each plan (one JSON list on stdin) through the parser, the canonical form and (with
# NVRTC) code generation and compilation; prints one JSON line per plan as soon as it is done, so
# that a crash names the plan that caused it.
_CHILD = r"""
import json, sys
from jaxfuse._extension import extension
ext = extension()
try:
    ext.gpu_compiler("CUDA")
    nvrtc = True
except RuntimeError:
    nvrtc = False
compiles = int(sys.argv[1])
seen = {}
for plan in json.load(sys.stdin):
    out = {}
    try:
        ext.cpu_prepare(plan)
        out["canonical"] = ext.plan_canonical(plan)
        out["recanonical"] = ext.plan_canonical(out["canonical"])
    except Exception as err:
        out["error"] = [type(err).__name__, str(err)]
    canonical = out.get("canonical")
    if canonical is not None and nvrtc and (canonical in seen or len(seen) < compiles):
        try:
            got = ext.gpu_compile_only("CUDA", plan, "sm_90")
            if canonical not in seen:
                seen[canonical] = ext.gpu_compile_only("CUDA", canonical, "sm_90")["source"]
            out["same_source"] = got["source"] == seen[canonical]
            out["first_line"] = got["source"].split("\n", 1)[0]
            out["binary_bytes"] = got["binary_bytes"]
        except Exception as err:
            out["compile_error"] = [type(err).__name__, str(err)]
    print(json.dumps(out), flush=True)
"""

@st.composite
def fuzzed_plans(draw: Any) -> str:
    """A valid plan after up to four random edits (:func:`cases.edited_plan`), or random
    text."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.one_of(st.text(max_size=80),
                              st.text(max_size=40).map(lambda t: "jaxfuse1;" + t)))
    return edited_plan(draw, draw(st.sampled_from(PLANS)), (0, 4))


def _run_child(plans: list[str], compiles: int) -> list[dict[str, Any]]:
    env = dict(os.environ, JAXFUSE_CACHE_DIR="")
    done = subprocess.run([sys.executable, "-P", "-c", _CHILD, str(compiles)],
                          input=json.dumps(plans), env=env, capture_output=True, text=True,
                          timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines()]
    if done.returncode != 0:
        culprit = plans[len(results)] if len(results) < len(plans) else None
        pytest.fail(f"the child exited with {done.returncode} on plan {culprit!r}:\n"
                    f"{done.stderr[-3000:]}")
    assert len(results) == len(plans)
    return results


def _check_fuzzed(plan: str, out: dict[str, Any]) -> None:
    if "error" in out:
        kind, message = out["error"]
        assert kind == "ValueError", (plan, out)
        assert message.startswith("invalid jaxfuse plan"), (plan, message)
        # Messages quote only grammar characters; anything else is escaped.
        assert message.isascii() and message.isprintable(), (plan, message)
        return
    assert GRAMMAR.fullmatch(plan), f"accepted a plan outside the grammar: {plan!r}"
    canonical = out["canonical"]
    assert canonical == canonical_oracle(plan), (plan, canonical)
    assert out["recanonical"] == canonical
    if "compile_error" in out:
        pytest.fail(f"accepted plan {plan!r} did not compile: {out['compile_error']}")
    if "same_source" in out:
        assert out["same_source"], f"{plan!r}: the source differs from the canonical plan's"
        assert out["first_line"] == f"// jaxfuse kernel for plan: {canonical}"
        assert out["binary_bytes"] > 0


def test_fuzzed_plans_are_refused_cleanly_or_compile_from_the_canonical_form() -> None:
    counts = {"refused": 0, "accepted": 0, "compiled": 0}

    @settings(max_examples=25 if EXPLORE else 2, deadline=None, derandomize=not EXPLORE,
              database=None, print_blob=EXPLORE,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(st.lists(fuzzed_plans(), min_size=150, max_size=250))
    def run(plans: list[str]) -> None:
        for plan, out in zip(plans, _run_child(plans, compiles=10 if NVRTC else 0)):
            _check_fuzzed(plan, out)
            counts["refused" if "error" in out else "accepted"] += 1
            counts["compiled"] += "same_source" in out

    run()
    # The mutations reach both sides of the parser (and, with NVRTC, the compiler).
    assert counts["refused"] > 100 and counts["accepted"] > 10, counts
    assert counts["compiled"] > 0 or not NVRTC, counts
