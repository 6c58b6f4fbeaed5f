"""A flat dataflow view of one jaxpr, for pattern matching.

Calls that only wrap other code (``jit``, custom-JVP/VJP calls, closed calls, ``remat``) are
expanded in place, so a pattern sees ``max(y, 0)`` whether it was written by hand or reached
through the custom-JVP and jit wrappers of ``jax.nn.relu``. Every expanded node remembers the
top-level equation it came from: the rewrite replaces top-level equations, never parts of them.
Control flow (scan, cond, while) stays opaque here; :mod:`jaxfuse.rewrite.fuse` rewrites its
bodies as scopes of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

__all__ = ["Graph", "Node", "Value", "call_name", "wrapped_jaxpr"]

# Call-like primitives whose body is inlined into the flat view, and the parameter holding it.
_WRAPPERS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
             "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
             "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}

# Constants are read (to find a 0.0 or a 6.0) only up to this size.
_MAX_CONSTANT_SIZE = 1 << 16

# Structural ops that keep a constant constant (used to read scalars such as 0.0 or 6.0).
_CONST_PASSTHROUGH = ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
                      "expand_dims", "copy")


def wrapped_jaxpr(eqn: JaxprEqn) -> tuple[Jaxpr, list[Any]] | None:
    """The body and consts of a call-like equation, or None for any other equation."""
    param = _WRAPPERS.get(eqn.primitive.name)
    body = eqn.params.get(param) if param else None
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    if isinstance(body, Jaxpr) and not body.constvars:
        return body, []
    return None


def call_name(eqn: JaxprEqn) -> str:
    """How reports name an equation: ``jit(relu)``, ``custom_jvp_call(f)``, or the primitive."""
    name = eqn.primitive.name
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if body is None or not (name in ("jit", "pjit") or name.startswith("custom_")):
        return name
    inner = eqn.params.get("name")
    if inner is None:
        info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
        inner = (getattr(info, "func_src_info", None) or "?").split(" ")[0]
    return f"{name}({inner})"


class Value:
    """One value of the flat view: a top-level variable, an inner variable, or a constant."""

    __slots__ = ("aval", "const", "is_output", "literal", "producer", "top_vars", "users")

    def __init__(self, aval: Any, producer: Node | None = None, literal: Any = None,
                 const: Any = None):
        self.aval = aval
        self.producer = producer
        self.literal = literal  # a Literal's value
        self.const = const  # a closed jaxpr's constant (maybe a tracer)
        self.users: list[Node] = []
        self.top_vars: list[Var] = []  # the scope's variables bound to this value
        self.is_output = False  # returned by the scope

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.aval.dtype)

    def __repr__(self) -> str:
        name = self.top_vars[0] if self.top_vars else "inner"
        return f"Value({name}: {self.aval.str_short()})"


class Node:
    """One primitive application of the flat view."""

    __slots__ = ("eqn", "inputs", "outputs", "top")

    def __init__(self, eqn: JaxprEqn, inputs: list[Value], top: int):
        self.eqn = eqn
        self.inputs = inputs
        self.outputs: list[Value] = []
        self.top = top  # index of the top-level equation this node belongs to

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self) -> dict[str, Any]:
        return self.eqn.params

    def __repr__(self) -> str:
        return f"Node({self.name} @ eqn {self.top})"


class Graph:
    """The flat view of one closed jaxpr: values, nodes, users, and constant folding."""

    def __init__(self, jaxpr: Jaxpr, consts: list[Any]):
        self.jaxpr = jaxpr
        self.nodes: list[Node] = []
        self.top_outputs: dict[int, list[Value]] = {}  # per top-level equation
        env: dict[Var, Value] = {}
        for var, const in zip(jaxpr.constvars, consts):
            env[var] = Value(var.aval, const=const)
        for var in jaxpr.invars:
            env[var] = Value(var.aval)
        for var, value in env.items():
            value.top_vars.append(var)
        for index, eqn in enumerate(jaxpr.eqns):
            outputs = self._expand(eqn, [self._read(env, a) for a in eqn.invars], index)
            self.top_outputs[index] = outputs
            for var, value in zip(eqn.outvars, outputs):
                env[var] = value
                value.top_vars.append(var)
        for atom in jaxpr.outvars:
            self._read(env, atom).is_output = True
        self.values: dict[Var, Value] = env

    @staticmethod
    def _read(env: dict[Var, Value], atom: Any) -> Value:
        if isinstance(atom, Literal):
            return Value(atom.aval, literal=atom.val)
        return env[atom]

    def _expand(self, eqn: JaxprEqn, inputs: list[Value], top: int) -> list[Value]:
        inner = wrapped_jaxpr(eqn)
        if inner is not None and len(inner[0].invars) == len(inputs):
            body, consts = inner
            env: dict[Var, Value] = {}
            for var, const in zip(body.constvars, consts):
                env[var] = Value(var.aval, const=const)
            env.update(zip(body.invars, inputs))
            for sub in body.eqns:
                outs = self._expand(sub, [self._read(env, a) for a in sub.invars], top)
                env.update(zip(sub.outvars, outs))
            return [self._read(env, a) for a in body.outvars]
        node = Node(eqn, inputs, top)
        for value in inputs:
            value.users.append(node)
        node.outputs = [Value(var.aval, producer=node) for var in eqn.outvars]
        self.nodes.append(node)
        return node.outputs

    # ----- constants --------------------------------------------------------------------------
    def uniform_constant(self, value: Value) -> float | None:
        """The number every element of `value` equals, when that is known at trace time."""
        array = self.constant(value)
        if array is None or array.size == 0:
            return None
        first = array.reshape(-1)[0]
        if not np.all(array == first):
            return None
        return float(first)

    def constant(self, value: Value, depth: int = 0) -> np.ndarray | None:
        """`value` as a NumPy array when it is a trace-time constant (else None)."""
        if value.literal is not None:
            return np.asarray(value.literal)
        if value.const is not None:
            if int(np.prod(value.shape)) > _MAX_CONSTANT_SIZE:
                return None  # a closed-over weight, not a scalar written in the program
            try:
                return np.asarray(value.const)
            except Exception:  # a tracer closed over from an outer trace is not a constant
                return None
        node = value.producer
        if node is None or depth > 8 or node.name not in _CONST_PASSTHROUGH:
            return None
        inner = self.constant(node.inputs[0], depth + 1)
        if inner is None:
            return None
        if node.name == "convert_element_type":
            return inner.astype(node.params["new_dtype"])
        if node.name == "broadcast_in_dim":
            shape = node.params["shape"]
            dims = node.params["broadcast_dimensions"]
            expanded = [1] * len(shape)
            for src, dst in enumerate(dims):
                expanded[dst] = inner.shape[src]
            return np.broadcast_to(inner.reshape(expanded), shape)
        return np.reshape(inner, value.shape)
