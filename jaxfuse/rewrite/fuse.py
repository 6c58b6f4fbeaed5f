"""``jaxfuse.fuse``: trace a function, replace its convolution chains with fused calls, run it.

The traced jaxpr is evaluated equation by equation under whatever trace calls the fused function
(eager, ``jax.jit``, ``vmap``...). Each matched group is replaced by one fused call, emitted where
the group's last equation was; every other equation is bound again as it was, with its source
information. Call-like and control-flow equations (jit, custom_jvp/vjp calls, scan, cond, while,
remat) get their bodies rewritten the same way and are bound again with the new bodies.
Conversions that only the fused calls read (Flax's float32 filters converted to the computation
dtype) are bound as one batched conversion per scope instead (:mod:`.converts`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, jaxpr_as_fun

from ..convert import convert_many
from ..find import FUSED
from ..solvers import XLA, solver_mode
from .choice import ChainCosts, choose_for_program
from .converts import ConvertBatch, plan_convert_batch
from .filters import widen_filters
from .graph import Graph, Value, call_name
from .lowering import build_plan, compile_plans, emit, plan_of
from .matcher import Group, Skipped, find_groups

__all__ = ["Recorder", "Rewriter", "StaticArgs", "fuse", "recording", "trace"]

# Primitives whose bodies are rewritten, and how a scope inside them is labelled in reports.
_CALLS = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}
_CONTROL = {"scan", "cond", "while"}
_REMAT = {"remat2", "checkpoint"}
# Parameters of those primitives that hold a body to rewrite (others, e.g. a custom rule's
# jaxpr thunks, keep the original definition).
_BODY_PARAMS = {"jaxpr", "call_jaxpr", "branches", "cond_jaxpr", "body_jaxpr"}


class Recorder:
    """Collects what the rewrite did in every scope (for :func:`jaxfuse.fusion_report`):
    per scope, the groups fused, the groups left to XLA by measurement, and the
    convolutions that could not start a chain; and the conversions batched."""

    def __init__(self) -> None:
        self.scopes: list[tuple[str, list[Group], list[Group], list[Skipped]]] = []
        self.notes: list[tuple[str, JaxprEqn, str]] = []
        self.solvers: dict[int, str] = {}  # id(group) -> what runs it (a kernel, or "xla")
        self.converts: list[tuple[str, int]] = []  # (scope, conversions batched into one op)


_recorder: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "jaxfuse_rewrite_recorder", default=None)


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Records every scope rewritten inside the block."""
    recorder = Recorder()
    token = _recorder.set(recorder)
    try:
        yield recorder
    finally:
        _recorder.reset(token)


def fuse(fn: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
         static_argnames: str | Sequence[str] = (), solver: str | None = None) -> Any:
    """Returns `fn` with every convolution chain it computes replaced by one fused kernel.

    A chain is a ``lax.conv_general_dilated`` (as ``flax.linen.Conv``, ``flax.nnx.Conv`` or
    hand-written code produce it) followed by any of: a per-channel bias add, batch-norm
    inference (written out, or as flax's BatchNorm computes it in eval mode, or pre-folded to
    ``y * a + c``), a residual add, and an activation (relu, relu6/clip, leaky relu, elu,
    sigmoid, tanh, softplus, abs, silu, gelu in both forms, hard_swish, hard_sigmoid, mish: the
    README lists the forms matched). Intermediate values used elsewhere keep the chain unfused
    at that point. Results match `fn` up to rounding.

    Each chain's plan is compiled with `solver` (see :meth:`jaxfuse.FusionPlan.compile`): in
    ``"auto"``, the default, both candidates are measured on this device and the program's
    chains are assigned together (device-bound programs by device time, launch-bound ones
    also by the host's launch work; :mod:`jaxfuse.rewrite.choice`); a chain given to XLA is
    left exactly as `fn` computes it. Float conversions that only fused calls read (every
    filter a Flax model keeps in float32 and computes with in bfloat16) run as one batched
    conversion, one GPU kernel instead of one each; results are bit for bit the same.

    Work on values known when the function is traced is done then, once: an inference
    function that closes over its variables, ``jax.jit(lambda x: fused(variables, x))``, gets
    a program of the fused calls and the work on `x` alone (batch norms folded, filters
    converted at trace time), and JAX passes it one argument instead of every variable.

    The fused function has `fn`'s signature; it traces `fn` on every call (wrap it in
    ``jax.jit`` to trace once). Arguments named with `static_argnums` / `static_argnames` (as
    for ``jax.jit``: a name also covers its position, and a position its name) reach `fn` as
    they are; so does every value that is not an array, which is how ``jax.jit(fuse(fn),
    static_argnums=...)`` hands over its static arguments. Works as a decorator.

    >>> import jax, jax.numpy as jnp, jaxfuse
    >>> @jaxfuse.fuse
    ... def layer(x, w, b):
    ...     y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
    ...     return jax.nn.relu(y + b[None, :, None, None])
    >>> y = layer(jnp.ones((1, 4, 8, 8)), jnp.ones((8, 4, 3, 3)), jnp.ones(8))
    """
    if fn is None:
        return functools.partial(fuse, static_argnums=static_argnums,
                                 static_argnames=static_argnames, solver=solver)
    statics = StaticArgs(static_argnums, static_argnames, fn)
    if solver is not None:
        solver_mode(solver)  # a bad name fails here, not at the first call

    @functools.wraps(fn)
    def fused(*args: Any, **kwargs: Any) -> Any:
        closed, out_tree, flat = trace(fn, statics, args, kwargs)
        outs = Rewriter(_recorder.get(), solver).evaluate(closed.jaxpr, closed.consts, flat)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    fused.__jaxfuse_fuse__ = (fn, statics, solver)  # type: ignore[attr-defined]
    return fused


class StaticArgs:
    """Which arguments of the fused function are static (Python values `fn` sees as they are).

    As ``jax.jit`` does, a static name that `fn`'s signature also takes by position makes that
    position static, and a static position a parameter's name."""

    def __init__(self, argnums: int | Sequence[int], argnames: str | Sequence[str],
                 fn: Callable[..., Any] | None = None):
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        names = (argnames,) if isinstance(argnames, str) else tuple(argnames)
        try:
            params = list(inspect.signature(fn).parameters.values()) if fn else []
        except (TypeError, ValueError):  # (a callable without a signature: as given)
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        by_name = {p.name: i for i, p in enumerate(positional)
                   if p.kind is p.POSITIONAL_OR_KEYWORD}
        self.argnums = nums + tuple(by_name[n] for n in names if n in by_name and
                                    by_name[n] not in nums)
        self.argnames = names + tuple(positional[i].name for i in nums
                                      if -len(positional) <= i < len(positional)
                                      and positional[i].name in by_name
                                      and positional[i].name not in names)


def _is_array(leaf: Any) -> bool:
    """Whether `fn` gets `leaf` abstract (an array, or a tracer of an outer transformation)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def trace(fn: Callable[..., Any], statics: StaticArgs, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> tuple[ClosedJaxpr, Any, list[Any]]:
    """Traces `fn` with its non-static arguments abstract: (jaxpr, output tree, flat args).

    Leaves that are not arrays (Python numbers, strings, objects: under ``jax.jit`` these are
    the arguments it was told are static) reach `fn` as they are."""
    nums = {i % len(args) for i in statics.argnums if -len(args) <= i < len(args)}
    dynamic = [a for i, a in enumerate(args) if i not in nums]
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in statics.argnames}
    leaves, in_tree = jax.tree_util.tree_flatten((dynamic, dyn_kwargs))
    abstract = [_is_array(leaf) for leaf in leaves]
    flat = [leaf for leaf, a in zip(leaves, abstract) if a]

    def flat_fn(*arrays: Any) -> Any:
        it = iter(arrays)
        dyn_args, dyn_kw = jax.tree_util.tree_unflatten(
            in_tree, [next(it) if a else leaf for leaf, a in zip(leaves, abstract)])
        it = iter(dyn_args)
        full = [args[i] if i in nums else next(it) for i in range(len(args))]
        return fn(*full, **{**kwargs, **dyn_kw})

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat)
    return closed, jax.tree_util.tree_structure(out_shape), flat


class Rewriter:
    """Evaluates jaxprs with their convolution chains fused; rewrites nested bodies once."""

    def __init__(self, recorder: Recorder | None = None, solver: str | None = None):
        self.recorder = recorder
        self.solver = solver
        self._bodies: dict[int, tuple[ClosedJaxpr, ClosedJaxpr]] = {}
        self._scope: list[str] = []
        self._conv_inside: dict[int, tuple[Jaxpr, bool]] = {}

    # ----- one scope --------------------------------------------------------------------------
    def evaluate(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        groups: list[Group] = []
        g = None
        if any(e.primitive.name == "conv_general_dilated" for e in jaxpr.eqns):
            g = Graph(jaxpr, list(consts))
            groups, skipped = find_groups(g, build_plan)
            compile_plans(groups, self.solver)
            solvers = self._program_choice(groups)
            # Chains XLA runs faster keep their own equations: plain jax.jit's program.
            to_xla = [group for group in groups if solvers[id(group)] == XLA]
            groups = [group for group in groups if solvers[id(group)] != XLA]
            # Fused groups whose own plan chose XLA run the plan that forces the kernel.
            forced = {id(group): FUSED for group in groups if plan_of(group).solver == XLA}
            # Kernels that read the program's float32 filters as they are (filters.py) run
            # the fused kernel too, and their filters' conversions go.
            groups, absorbed = widen_filters(g, groups, forced)
            forced.update((id(group), FUSED) for group in groups
                          if group.filter_source is not None)
            if self.recorder is not None:
                self.recorder.scopes.append(("/".join(self._scope), groups, to_xla, skipped))
                for group in groups:
                    self.recorder.solvers[id(group)] = plan_of(group, forced.get(id(group))).solver
        else:
            forced, absorbed = {}, frozenset()
        # Conversions only the fused calls read become one op (one GPU kernel).
        batch = plan_convert_batch(g, groups) if g is not None else None
        if batch is not None and self.recorder is not None:
            self.recorder.converts.append(("/".join(self._scope), len(batch.values)))
        consumed = set().union(*(group.tops for group in groups), absorbed)
        if batch is not None:
            consumed |= batch.eqns
        emit_at = {group.emit_at: group for group in groups}
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        inner: dict[Value, Any] = {}

        def read(value: Value) -> Any:
            for var in value.top_vars:
                if var in env:
                    return env[var]
            if value.literal is not None:
                return value.literal
            if value.const is not None:
                return value.const
            if value not in inner:  # an off-chain value inside a replaced wrapper: compute it
                node = value.producer
                outs = _bind(node.eqn, [read(v) for v in node.inputs])
                inner.update(zip(node.outputs, outs))
            return inner[value]

        for index, eqn in enumerate(jaxpr.eqns):
            if batch is not None and index == batch.emit_at:
                _emit_batch(batch, read, env)
            if index in emit_at:
                group = emit_at[index]
                # The chain's parameters that are known when the program is traced (closed
                # over) are prepared then (folded, reshaped, widened), not on every call.
                with _source_context(group.conv.eqn), jax.ensure_compile_time_eval():
                    result = emit(group, read, g, forced.get(id(group)))
                for var in group.out.top_vars:
                    env[var] = result
                continue
            if index in consumed:
                continue
            invals = [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]
            # Work on values known when the program is traced (the variables an inference
            # function closes over: its batch-norm statistics folded, its filters converted)
            # is done then, once, not on every call.
            known = _foldable(eqn, invals)
            with jax.ensure_compile_time_eval() if known else contextlib.nullcontext():
                outs = self._bind_rewritten(eqn, invals)
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, DropVar):
                    env[var] = val
        return [a.val if isinstance(a, Literal) else env[a] for a in jaxpr.outvars]

    def _program_choice(self, groups: list[Group]) -> dict[int, str]:
        """What runs each group, id(group) -> FUSED or XLA: in auto mode the program's choice
        (choice.py), else each plan's own. A group the program runs fused although its plan
        chose XLA gets the plan that forces the fused kernel (compiled here)."""
        own = {id(g): XLA if plan_of(g).solver == XLA else FUSED for g in groups}
        if solver_mode(self.solver) != "auto":
            return own
        by_plan: dict[int, list[Group]] = {}
        for group in groups:
            by_plan.setdefault(id(plan_of(group)), []).append(group)
        chains = []
        for key, members in by_plan.items():
            info = plan_of(members[0]).kernel_info
            chains.append(ChainCosts(key, len(members), own[id(members[0])],
                                     info.get("candidates_device_us", {}),
                                     info.get("candidates_host_us", {})))
        choice = choose_for_program(chains)
        solvers = {}
        for key, members in by_plan.items():
            if choice[key] == FUSED and own[id(members[0])] == XLA:
                plan_of(members[0], FUSED).compile(solver=FUSED)
            solvers.update((id(group), choice[key]) for group in members)
        return solvers

    # ----- nested bodies ----------------------------------------------------------------------
    def _bind_rewritten(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        if not any(self._has_conv(j) for j in _jaxprs_in(eqn.params)):
            return _bind(eqn, invals)
        if name not in _CALLS | _CONTROL | _REMAT:
            if self.recorder is not None:
                self.recorder.notes.append(("/".join(self._scope), eqn,
                                            f"convolutions inside `{name}` are not searched"))
            return _bind(eqn, invals)
        params = dict(eqn.params)
        for key, val in eqn.params.items():
            if key not in _BODY_PARAMS:
                continue
            label = _label(eqn, key)
            if isinstance(val, ClosedJaxpr):
                params[key] = self.rewrite_body(val, label)
            elif isinstance(val, tuple) and all(isinstance(v, ClosedJaxpr) for v in val):
                params[key] = tuple(self.rewrite_body(v, f"{label}[{i}]")
                                    for i, v in enumerate(val))
            elif isinstance(val, Jaxpr) and name in _REMAT:
                body = self.rewrite_body(ClosedJaxpr(val, []), label)
                if body.consts:  # an open body cannot carry constants: let checkpoint hoist them
                    remat = jax.checkpoint(jaxpr_as_fun(body), prevent_cse=params["prevent_cse"],
                                           policy=params["policy"])
                    with _source_context(eqn):
                        return list(remat(*invals))
                params[key] = body.jaxpr
        return _bind(eqn, invals, params)

    def rewrite_body(self, closed: ClosedJaxpr, label: str) -> ClosedJaxpr:
        """`closed` with its chains fused (the same object when nothing inside can change)."""
        hit = self._bodies.get(id(closed))
        if hit is not None:
            return hit[1]
        new = closed
        avals = closed.in_avals
        if self._has_conv(closed.jaxpr) and all(hasattr(a, "shape") for a in avals):
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
                     for a in avals]
            self._scope.append(label)
            try:
                new = jax.make_jaxpr(
                    lambda *a: self.evaluate(closed.jaxpr, closed.consts, a))(*specs)
            finally:
                self._scope.pop()
            if [(a.shape, a.dtype, a.weak_type) for a in new.out_avals] != \
                    [(a.shape, a.dtype, a.weak_type) for a in closed.out_avals]:
                raise AssertionError(f"jaxfuse rewrite changed the result types of {label}: "
                                     f"{closed.out_avals} -> {new.out_avals}")
        self._bodies[id(closed)] = (closed, new)  # keeps `closed` alive, so its id stays unique
        return new

    def _has_conv(self, jaxpr: Jaxpr) -> bool:
        """Whether `jaxpr` or any body inside it has a convolution."""
        hit = self._conv_inside.get(id(jaxpr))
        if hit is not None:
            return hit[1]
        found = any(e.primitive.name == "conv_general_dilated" or
                    any(self._has_conv(j) for j in _jaxprs_in(e.params)) for e in jaxpr.eqns)
        self._conv_inside[id(jaxpr)] = (jaxpr, found)  # keeps `jaxpr` alive: its id stays unique
        return found


# Trace-time work makes results no larger than its operands (a per-channel vector folded,
# reshaped, converted), or than this many elements: not a scalar broadcast to an activation's
# shape, which XLA fuses into its users for free and a constant would make every call read.
_FOLD_MAX_GROWN = 256


def _foldable(eqn: JaxprEqn, invals: Sequence[Any]) -> bool:
    """Whether `eqn` is done when tracing: its operands are all known then, it has no effects,
    and its results are not much larger than its operands."""
    if not invals or eqn.effects or any(isinstance(v, jax.core.Tracer) for v in invals):
        return False
    size_in = sum(int(getattr(v, "size", 1)) for v in invals)
    size_out = sum(int(np.prod(v.aval.shape)) for v in eqn.outvars
                   if hasattr(v.aval, "shape"))
    return size_out <= max(size_in, _FOLD_MAX_GROWN)


def _emit_batch(batch: ConvertBatch, read: Callable[[Value], Any], env: dict[Any, Any]) -> None:
    """Binds the batched conversion and gives each converted value its result.

    Sources known when the program is traced (variables the jitted function closes over, as
    an inference server's does) are converted then, once, instead of on every call: their
    results are constants of the program (converted exactly as the op would)."""
    sources = [read(source) for source in batch.sources]
    is_traced = [isinstance(s, jax.core.Tracer) for s in sources]
    known = [i for i, t in enumerate(is_traced) if not t]
    traced = [i for i, t in enumerate(is_traced) if t]
    outs: list[Any] = [None] * len(sources)
    for part, at_trace_time in ((known, True), (traced, False)):
        if not part:
            continue
        with jax.ensure_compile_time_eval() if at_trace_time else contextlib.nullcontext():
            converted = convert_many([sources[i] for i in part], [batch.dtypes[i] for i in part])
        for i, out in zip(part, converted):
            outs[i] = out
    for value, out in zip(batch.values, outs):
        for var in value.top_vars:
            env[var] = out


def _bind(eqn: JaxprEqn, invals: Sequence[Any], params: dict[str, Any] | None = None
          ) -> list[Any]:
    """Binds `eqn`'s primitive again, under the equation's source information."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns: tuple[Any, ...] = ()
    if isinstance(bind_params, tuple):  # jax versions that split off sub-functions
        subfuns, bind_params = bind_params
    with _source_context(eqn):
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def _source_context(eqn: JaxprEqn) -> Iterator[None]:
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None) or contextlib.nullcontext()
    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack), manager:
        yield


def _label(eqn: JaxprEqn, key: str) -> str:
    name = eqn.primitive.name
    if name in _CALLS:
        return call_name(eqn)
    if name == "while":
        return "while." + key.removesuffix("_jaxpr")
    return {"remat2": "checkpoint"}.get(name, name)


def _jaxprs_in(params: dict[str, Any]) -> Iterator[Jaxpr]:
    for val in params.values():
        for v in val if isinstance(val, tuple) else (val,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v
