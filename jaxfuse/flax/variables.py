"""Moving linen variables between unfused ``nn.Conv`` + ``nn.BatchNorm`` pairs and ConvBNAct.

A :class:`jaxfuse.flax.linen.ConvBNAct` keeps the conv's variables under ``conv`` and the batch
norm's under ``bn``, in every collection (``params/conv/{kernel,bias}``,
``params/bn/{scale,bias}``, ``batch_stats/bn/{mean,var}``). An unfused model whose pair is
named differently (``Conv_0`` / ``BatchNorm_0``, or in different submodules) needs its
subtrees moved; these functions do that and nothing else: arrays are not copied or cast.
Paths are ``"a/b"`` strings or tuples of names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["conv_bn_variables", "fuse_conv_bn_variables", "split_conv_bn_variables"]

Path = str | Sequence[str]
Variables = Mapping[str, Any]


def _keys(path: Path) -> tuple[str, ...]:
    keys = tuple(path.split("/")) if isinstance(path, str) else tuple(path)
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"a variable path must be 'a/b' or a tuple of names, got {path!r}")
    return keys


def _as_dict(tree: Any) -> Any:
    """Nested plain dicts (FrozenDicts unfrozen); leaves untouched."""
    if isinstance(tree, Mapping):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree


def _get(tree: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    node: Any = tree
    for i, key in enumerate(keys):
        if not isinstance(node, Mapping) or key not in node:
            have = sorted(node) if isinstance(node, Mapping) else []
            raise KeyError(f"no {'/'.join(keys[:i + 1])!r} in the variables (found {have} at "
                           f"{'/'.join(keys[:i]) or 'the top level'})")
        node = node[key]
    return node


def _pop(tree: dict[str, Any], keys: tuple[str, ...]) -> Any:
    parents = [tree]
    for key in keys[:-1]:
        parents.append(parents[-1][key])
    value = parents[-1].pop(keys[-1])
    for parent, key in zip(reversed(parents[:-1]), reversed(keys[:-1])):
        if parent[key]:
            break
        del parent[key]  # drop containers the move left empty
    return value


def _put(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    if keys[-1] in tree:
        raise ValueError(f"the variables already hold {'/'.join(keys)!r}")
    tree[keys[-1]] = value


def _check_pair(variables: Variables, conv: tuple[str, ...], bn: tuple[str, ...]) -> None:
    params = variables.get("params", {})
    if "kernel" not in _get(params, conv):
        raise KeyError(f"params/{'/'.join(conv)} is not an nn.Conv (no 'kernel')")
    _get(params, bn)
    stats = _get(variables.get("batch_stats", {}), bn)
    missing = {"mean", "var"} - set(stats)
    if missing:
        raise KeyError(f"batch_stats/{'/'.join(bn)} is not an nn.BatchNorm (no {sorted(missing)})")


def conv_bn_variables(variables: Variables, conv: Path = "Conv_0",
                      bn: Path = "BatchNorm_0") -> dict[str, Any]:
    """The variables of one ``nn.Conv`` + ``nn.BatchNorm`` pair in ConvBNAct's layout.

    Args:
      variables: collections (``{"params": ..., "batch_stats": ...}``) of a module holding
        the pair, e.g. what ``model.init`` returned or a restored checkpoint.
      conv, bn: paths of the two layers inside each collection.

    Returns:
      ``{"params": {"conv": ..., "bn": ...}, "batch_stats": {"bn": ...}}``, ready for
      ``ConvBNAct(...).apply``.

    >>> v = {"params": {"Conv_0": {"kernel": 1, "bias": 2}, "BatchNorm_0": {"scale": 3,
    ...      "bias": 4}}, "batch_stats": {"BatchNorm_0": {"mean": 5, "var": 6}}}
    >>> fused = conv_bn_variables(v)
    >>> fused["params"]
    {'conv': {'kernel': 1, 'bias': 2}, 'bn': {'scale': 3, 'bias': 4}}
    >>> fused["batch_stats"]
    {'bn': {'mean': 5, 'var': 6}}
    """
    return _extract(variables, _keys(conv), _keys(bn))


def _extract(variables: Variables, conv: tuple[str, ...], bn: tuple[str, ...]
             ) -> dict[str, Any]:
    _check_pair(variables, conv, bn)
    out: dict[str, Any] = {}
    for collection, tree in variables.items():
        entry = {}
        for name, keys in (("conv", conv), ("bn", bn)):
            try:
                entry[name] = _as_dict(_get(tree, keys))
            except KeyError:
                continue  # e.g. the conv has no batch_stats
        if entry:
            out[collection] = entry
    return out


def split_conv_bn_variables(variables: Variables, conv: Path = "conv",
                            bn: Path = "bn") -> dict[str, Any]:
    """The inverse of :func:`conv_bn_variables`: a ConvBNAct's variables as a conv at `conv`
    and a batch norm at `bn` (the defaults give ``nn.Conv(name="conv")`` and
    ``nn.BatchNorm(name="bn")``)."""
    _check_pair(variables, ("conv",), ("bn",))
    out: dict[str, Any] = {}
    for collection, tree in variables.items():
        for name, keys in (("conv", _keys(conv)), ("bn", _keys(bn))):
            if isinstance(tree, Mapping) and name in tree:
                _put(out.setdefault(collection, {}), keys, _as_dict(tree[name]))
    return out


def fuse_conv_bn_variables(variables: Variables,
                           pairs: Mapping[Path, tuple[Path, Path]]) -> dict[str, Any]:
    """A whole model's variables with (conv, bn) pairs moved into ConvBNAct layers.

    Args:
      variables: the unfused model's collections.
      pairs: ``{fused_path: (conv_path, bn_path)}``: each ConvBNAct's path in the fused model
        and the layers whose variables it takes over. Everything else stays where it is.

    Returns:
      New nested dicts (the arrays are shared, not copied).
    """
    out = _as_dict(variables)
    for fused, (conv, bn) in pairs.items():
        target, conv_keys, bn_keys = _keys(fused), _keys(conv), _keys(bn)
        _check_pair(out, conv_keys, bn_keys)
        for tree in out.values():
            for name, keys in (("conv", conv_keys), ("bn", bn_keys)):
                try:
                    _get(tree, keys)
                except KeyError:
                    continue
                _put(tree, (*target, name), _pop(tree, keys))
    return out
