"""Nested-dict trees of tensors.

A **tree** is a nested ``dict[str, tree | Tensor]`` whose keys follow the module
tree of a model::

    {"encoder": {"layers": {"0": {"q": {"weight": t}}}}}

The dotted **path** of a leaf joins its keys with ``"."`` exactly as
``model.named_parameters()`` spells it (``"encoder.layers.0.q.weight"``).

Conventions shared by every function here:

* Leaves are tensors (``nn.Parameter`` included). A ``None`` leaf means
  *absent*: it is skipped everywhere, exactly as if its key were missing.
  Empty dicts hold no leaves and are likewise invisible; functions that
  build trees never create them.
* Keys are non-empty strings (``ValueError`` otherwise, naming the key); any
  other leaf type raises ``TypeError`` naming its path.
* A **flat path-keyed dict** (``{"0.weight": t}``, what ``state_dict`` and
  ``torch.func.functional_call`` use) is a tree too: a key with ``"."`` stands
  for the nested keys it joins (no empty component), and the two forms may be
  mixed. Two keys naming the same path, or a leaf at a prefix of another
  leaf's path, raise ``ValueError``. ``map`` and ``unflatten`` give back the
  keys of their input as they were (flat, nested or mixed), so that the leaves
  of the result walk in the same order; ``from_flat_dict`` / ``to_flat_dict``
  convert between the forms.
* Leaves are visited depth-first in insertion order.
* A tensor object reachable at several paths is a *tied* leaf. ``paths``,
  ``leaves``, ``map`` and ``to_flat_dict`` visit it at each path;
  ``flatten`` stores it once and ``unflatten`` restores one object at all of
  its paths. ``flatten`` also ties views of the very same memory (same place,
  dtype, shape and strides) that do not require grad: a ``state_dict`` holds one
  such view per path of a tied parameter. ``from_module`` lists a tied
  parameter once, at its first path.

This module knows nothing of trainability; it imports only torch, the
standard library and the shared argument checks (:mod:`torchstruct._checks`).
``map`` and ``reduce`` shadow builtins inside it: the builtins are reached
through :mod:`builtins` where needed.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from . import _derivatives
from ._checks import check_bool, check_callable

__all__ = [
    "LeafSpec",
    "TreeSpec",
    "paths",
    "leaves",
    "map",
    "reduce",
    "flatten",
    "unflatten",
    "from_module",
    "to_flat_dict",
    "from_flat_dict",
]

Tree = dict  # a nested ``dict[str, Tree | Tensor | None]``


# ---------------------------------------------------------------------------
# The two walkers: tree -> (path, leaf) pairs, and (path, leaf) pairs -> tree.
# ---------------------------------------------------------------------------

def _check_key(key: Any, parent: str) -> bool:
    """Check one key; True when it is dotted (stands for several levels)."""
    where = repr(parent) if parent else "the root"
    if not isinstance(key, str):
        raise ValueError(f"tree keys must be strings; got {key!r} ({type(key).__name__}) under {where}")
    if "." not in key:
        if not key:
            raise ValueError(f"tree key {key!r} under {where} must be non-empty")
        return False
    if not builtins.all(key.split(".")):
        raise ValueError(f"tree key {key!r} under {where} has an empty component")
    return True


def _items(tree: Tree, prefix: str, dotted: list) -> Iterator[tuple[str, Tensor]]:
    if not isinstance(tree, dict):
        where = f"at {prefix!r}" if prefix else "at the root"
        raise TypeError(f"a tree must be a dict {where}; got {type(tree).__name__}")
    for key, value in tree.items():
        if _check_key(key, prefix):
            dotted[0] = True
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Tensor):
            yield path, value
        elif isinstance(value, dict):
            yield from _items(value, path, dotted)
        elif value is not None:
            raise TypeError(f"tree leaf at {path!r} must be a Tensor, a dict or None; got {type(value).__name__}")


def _walk(tree: Tree, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """``(path, leaf)`` depth-first, validating keys and leaf types. With dotted keys (a flat
    path-keyed dict, or a mix), the paths are checked to name distinct, non-nested leaves."""
    dotted = [False]
    items = list(_items(tree, prefix, dotted))
    if dotted[0]:
        seen: set = set()
        for path, _ in items:
            if path in seen:
                raise ValueError(f"duplicate path {path!r} (a dotted key and nested keys name "
                                 f"the same leaf)")
            seen.add(path)
        for path, _ in items:
            for pre in _prefixes(path):
                if pre in seen:
                    raise ValueError(f"conflicting paths {pre!r} and {path!r}: {pre!r} is a leaf")
    return iter(items)


def _skeleton(tree: Tree) -> tuple:
    """The keys of a (validated) tree, nested as in it: ``((key, None | skeleton), ...)``,
    ``None`` for a leaf. Keeps what a tree of paths cannot: which keys are dotted."""
    return tuple((k, _skeleton(v) if isinstance(v, dict) else None)
                 for k, v in tree.items() if v is not None)


def _rebuild(skeleton: tuple, values: Mapping[str, Any], prefix: str = "") -> Tree:
    """A tree with the keys of ``skeleton`` (same nesting, same order) and the leaves of
    ``values`` (path -> Tensor or None); ``None`` leaves and the dicts they leave empty are
    dropped."""
    out: Tree = {}
    for key, sub in skeleton:
        path = f"{prefix}.{key}" if prefix else key
        if sub is None:
            value = values[path]
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"leaf at {path!r} must be a Tensor or None; got {type(value).__name__}")
            if value is not None:
                out[key] = value
        else:
            child = _rebuild(sub, values, path)
            if child:
                out[key] = child
    return out


def _memory(t: Tensor) -> tuple | None:
    """A key shared by ``t`` and every view of the very same memory with its dtype, shape and
    strides (``state_dict`` holds such views for a tied parameter); ``None`` where there is no
    memory to compare (meta, empty, tensor subclasses without storage)."""
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if ptr == 0:
        return None
    # (a conjugate or negative view holds other values on the same memory)
    return (t.device, t.dtype, t.shape, t.stride(), ptr, t.is_conj(), t.is_neg())


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """``a`` is ``b``, or a view of the very same memory (see :func:`_memory`)."""
    return a is b or ((key := _memory(a)) is not None and key == _memory(b))


def _tie_keys(leaf: Tensor) -> tuple:
    """What ties two leaves of a tree (one is stored, counted and scaled once): the very same
    object, or, for a leaf that carries no derivative, a view of the very same memory (a
    ``state_dict``'s entries for a tied parameter). Leaves that require grad or hold a
    forward-mode tangent tie only as one object: two views of one parameter may be meant as two
    inputs of a graph, and two duals of one primal may carry different tangents."""
    memory = None if leaf.requires_grad or _derivatives.has_tangent(leaf) else _memory(leaf)
    return (id(leaf),) if memory is None else (id(leaf), memory)


def _distinct_items(tree: Tree) -> list[tuple[str, Tensor]]:
    """``(path, leaf)`` of ``tree`` in the order of :func:`paths`, each tied tensor once (at
    its first path), as :func:`flatten` stores them."""
    seen: set = set()
    out = []
    for path, leaf in _walk(tree):
        keys = _tie_keys(leaf)
        if seen.isdisjoint(keys):
            seen.update(keys)
            out.append((path, leaf))
    return out


def _prefixes(path: str) -> Iterator[str]:
    """The proper prefixes of a dotted path: ``"a.b.c"`` -> ``"a"``, ``"a.b"``."""
    parts = path.split(".")
    for k in range(1, len(parts)):
        yield ".".join(parts[:k])


def _is_flat(tree: Tree) -> bool:
    """A flat path-keyed dict: dotted keys and no nested dicts (without a dotted key, the
    flat and the nested form of a dict are the same)."""
    return (isinstance(tree, dict) and builtins.any("." in k for k in tree if isinstance(k, str))
            and not builtins.any(isinstance(v, dict) for v in tree.values()))


def _insert(root: Tree, path: Any, value: Any) -> None:
    """Put ``value`` at dotted ``path`` in ``root``, creating dicts on the way.

    ``None`` values are skipped (absent). Raises ``ValueError`` for a bad path or
    when ``path`` conflicts with a leaf already in ``root``.
    """
    if not isinstance(path, str):
        raise ValueError(f"paths must be strings; got {path!r} ({type(path).__name__})")
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise TypeError(f"leaf at {path!r} must be a Tensor or None; got {type(value).__name__}")
    *parents, last = path.split(".")
    if not builtins.all(parents + [last]):
        raise ValueError(f"path {path!r} has an empty component")
    node, prefix = root, ""
    for key in parents:
        prefix = f"{prefix}.{key}" if prefix else key
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"conflicting paths {prefix!r} and {path!r}: {prefix!r} is a leaf")
        node = child
    if last in node:
        existing = node[last]
        if isinstance(existing, dict):
            inner = next(_walk(existing, path))[0]
            raise ValueError(f"conflicting paths {inner!r} and {path!r}: {path!r} is a subtree")
        raise ValueError(f"duplicate path {path!r}")
    node[last] = value


# ---------------------------------------------------------------------------
# Public functions.
# ---------------------------------------------------------------------------

def paths(tree: Tree) -> list[str]:
    """Dotted paths of the leaves of ``tree``, depth-first in insertion order.

    Arguments:
        tree: a nested dict of tensors; ``None`` leaves are skipped.

    Returns:
        A list of dotted paths, one per leaf (a tied tensor once per path).

    Raises:
        TypeError: ``tree`` is not a dict, or a leaf is neither Tensor, dict nor None.
        ValueError: a key is not a non-empty string, a dotted key has an empty component
            (``"a..b"``), or two keys name the same path.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> T.paths({"enc": {"weight": torch.ones(2), "bias": None}, "head": torch.ones(1)})
        ['enc.weight', 'head']
    """
    return [path for path, _ in _walk(tree)]


def leaves(tree: Tree) -> list[Tensor]:
    """The leaves of ``tree`` in the order of :func:`paths`.

    Arguments:
        tree: a nested dict of tensors; ``None`` leaves are skipped.

    Returns:
        A list of the leaf tensors themselves (not copies).

    Raises:
        TypeError, ValueError: as :func:`paths`.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> a, b = torch.zeros(2), torch.ones(3)
        >>> [x is y for x, y in zip(T.leaves({"a": a, "n": {"b": b}}), [a, b])]
        [True, True]
    """
    return [leaf for _, leaf in _walk(tree)]


def map(f: Callable[..., Tensor | None], tree: Tree, *rest: Tree) -> Tree:
    """Apply ``f(leaf, *leaves_of_rest_at_same_path)`` at every leaf of ``tree``.

    Arguments:
        f: called once per path of ``tree`` (in order) with the leaf of ``tree``
            and the leaves of each tree in ``rest`` at the same path. It returns a
            Tensor, or ``None`` to drop that leaf (dicts left empty are pruned).
        tree: the tree whose keys the result takes, as they are nested (a flat path-keyed
            dict gives a flat dict).
        *rest: trees with exactly the same paths as ``tree`` (their insertion
            order may differ; ``None`` leaves count as absent).

    Returns:
        A new tree with the same paths as ``tree`` minus those where ``f``
        returned ``None``.

    Raises:
        ValueError: a tree in ``rest`` lacks a path of ``tree`` or has an extra
            one; the message names the first such path and the argument.
        TypeError: ``f`` is not callable, a tree in ``rest`` is not a dict (named), ``f``
            returned something that is neither Tensor nor None, or as :func:`paths`.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> x = {"a": torch.tensor([1.0, 2.0]), "b": {"c": torch.tensor(3.0)}}
        >>> y = {"b": {"c": torch.tensor(1.0)}, "a": torch.tensor([1.0, 1.0])}
        >>> T.to_flat_dict(T.map(lambda u, v: u - v, x, y))
        {'a': tensor([0., 1.]), 'b.c': tensor(2.)}
        >>> T.paths(T.map(lambda u: u if u.dim() else None, x))
        ['a']
    """
    check_callable(f, "f", "map")
    items = list(_walk(tree))
    others = []
    for i, other in enumerate(rest):
        who = f"rest[{i}] (tree number {i + 2}, counting `tree` as 1)"
        if not isinstance(other, dict):
            raise TypeError(f"map: {who} must be a tree (a dict); got {type(other).__name__}")
        flat = dict(_walk(other))
        for path, _ in items:
            if path not in flat:
                raise ValueError(f"tree structures differ: {who} has no leaf at {path!r}")
        if len(flat) != len(items):
            own = {path for path, _ in items}
            extra = next(path for path in flat if path not in own)
            raise ValueError(f"tree structures differ: {who} has an extra leaf at {extra!r}")
        others.append(flat)
    results = {path: f(leaf, *(o[path] for o in others)) for path, leaf in items}
    return _rebuild(_skeleton(tree), results)  # the keys of `tree`: flat, nested or mixed


def reduce(f: Callable[[Any, Tensor], Any], tree: Tree, init: Any) -> Any:
    """Left fold over the leaves of ``tree`` in order: ``f(...f(f(init, l0), l1)..., ln)``.

    Arguments:
        f: the binary function ``f(acc, leaf) -> acc``.
        tree: the tree to fold over.
        init: the starting accumulator (returned as is for a tree without leaves).

    Returns:
        The final accumulator.

    Raises:
        TypeError: ``f`` is not callable.
        TypeError, ValueError: as :func:`paths`.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> T.reduce(lambda n, x: n + x.numel(), {"a": torch.ones(2, 3), "b": {"c": torch.ones(4)}}, 0)
        10
    """
    check_callable(f, "f", "reduce")
    return functools.reduce(f, (leaf for _, leaf in _walk(tree)), init)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one leaf lives in a flat vector made by :func:`flatten`.

    Attributes:
        path: the dotted path of the leaf.
        shape: the leaf's shape.
        dtype: the leaf's dtype (``unflatten`` casts back to it).
        offset: index of the leaf's first element in the vector.
        alias_of: for a tied leaf (a tensor object already seen at an earlier
            path), that earlier path; it then shares the earlier leaf's
            storage in the vector. ``None`` otherwise.
    """

    path: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    alias_of: str | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the leaf."""
        return self.shape.numel()


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The immutable description of a flattened tree, made by :func:`flatten`.

    Attributes:
        entries: one :class:`LeafSpec` per path, in tree order.
        dtype: the dtype of the flat vector (promotion of all leaf dtypes).
        flat: the tree was a flat path-keyed dict (``unflatten`` gives one back).
        skeleton: the tree's keys as they were nested (dotted keys kept), which ``unflatten``
            rebuilds.

    Properties:
        paths: the dotted paths, in order (tied leaves at each of their paths).
        numel: the length of the flat vector (tied leaves counted once).
    """

    entries: tuple[LeafSpec, ...]
    dtype: torch.dtype
    flat: bool = False
    # the keys of the flattened tree, nested as they were (see _skeleton): unflatten gives
    # back the same keys, so that its leaves walk in the order of `paths`
    skeleton: tuple | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(e.path for e in self.entries)

    @property
    def numel(self) -> int:
        return builtins.sum(e.numel for e in self.entries if e.alias_of is None)


def flatten(tree: Tree) -> tuple[Tensor, TreeSpec]:
    """Concatenate all leaves of ``tree`` into one 1-D vector.

    Each leaf is flattened and cast to the promoted dtype of all leaves
    (``torch.promote_types``: fp16 + bf16 -> fp32, int64 + fp32 -> fp32). A
    tensor object found at several paths (tied) is stored once, and so are views of the very
    same memory that do not require grad (a ``state_dict``'s entries for a tied parameter).
    The result is differentiable with respect to the leaves (it is a ``torch.cat``).

    Arguments:
        tree: a nested dict of tensors, all on one device.

    Returns:
        ``(vector, spec)``: the 1-D vector (an empty float32 vector for a tree
        without leaves) and the :class:`TreeSpec` that :func:`unflatten` needs.

    Raises:
        ValueError: leaves live on different devices (names two paths and
            their devices), or as :func:`paths`.
        TypeError: a sparse (non-strided) leaf or an uninitialized lazy parameter (its
            path named), or as :func:`paths`.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> w = torch.tensor([1.0, 2.0])
        >>> vec, spec = T.flatten({"a": w, "b": {"c": torch.tensor(3, dtype=torch.int64)}, "tied": w})
        >>> vec
        tensor([1., 2., 3.])
        >>> spec.numel, spec.paths, spec.entries[2].alias_of
        (3, ('a', 'b.c', 'tied'), 'a')
    """
    entries: list[LeafSpec] = []
    chunks: list[Tensor] = []
    first_path: dict = {}  # a tie key -> the first path holding it
    by_path: dict[str, LeafSpec] = {}
    dtype: torch.dtype | None = None
    device_path: tuple[str, torch.device] | None = None
    offset = 0
    for path, leaf in _walk(tree):
        if leaf.layout != torch.strided:
            raise TypeError(
                f"flatten: the leaf at {path!r} has layout {leaf.layout} (sparse); only strided "
                f"tensors can be flattened (densify it with .to_dense() first)"
            )
        if device_path is None:
            device_path = (path, leaf.device)
        elif leaf.device != device_path[1]:
            raise ValueError(
                f"all leaves must be on one device: {device_path[0]!r} is on {device_path[1]}, "
                f"{path!r} is on {leaf.device}"
            )
        if nn.parameter.is_lazy(leaf):
            raise TypeError(
                f"flatten: the leaf at {path!r} is an uninitialized lazy parameter (an "
                f"nn.Lazy* module before its first forward); run one forward first"
            )
        keys = _tie_keys(leaf)
        seen = next((first_path[k] for k in keys if k in first_path), None)
        if seen:
            entry = dataclasses.replace(by_path[seen], path=path, alias_of=seen)
        else:
            for k in keys:
                first_path.setdefault(k, path)
            entry = LeafSpec(path, leaf.shape, leaf.dtype, offset)
            offset += leaf.numel()
            chunks.append(leaf.reshape(-1))
            dtype = leaf.dtype if dtype is None else torch.promote_types(dtype, leaf.dtype)
        by_path[path] = entry
        entries.append(entry)
    flat, skeleton = _is_flat(tree), _skeleton(tree)
    if dtype is None:
        return torch.empty(0, dtype=torch.float32), TreeSpec((), torch.float32, flat, skeleton)
    vector = torch.cat([c.to(dtype) for c in chunks])
    return vector, TreeSpec(tuple(entries), dtype, flat, skeleton)


def unflatten(vector: Tensor, spec: TreeSpec) -> Tree:
    """Rebuild the tree described by ``spec`` from a flat vector; the inverse of :func:`flatten`.

    Each leaf is a reshaped slice of ``vector`` cast to the leaf's recorded
    dtype: a view sharing memory with ``vector`` when the dtypes agree, a copy
    otherwise. Tied leaves come back as one tensor object at all their paths.
    The round trip is bitwise exact whenever each leaf's cast to ``spec.dtype``
    is exact. The vector may have any dtype and device.

    Arguments:
        vector: a 1-D tensor of length ``spec.numel``.
        spec: the :class:`TreeSpec` returned by :func:`flatten`.

    Returns:
        A tree with the paths ``spec.paths``, in that order, and the keys of the tree
        ``spec`` was made from (a flat path-keyed dict when that was one).

    Raises:
        TypeError: ``spec`` is not a TreeSpec or ``vector`` not a Tensor, or ``vector`` is
            complex with a non-zero imaginary part in the elements of a real leaf (the cast
            would drop it).
        ValueError: ``vector`` is not 1-D or its length is not ``spec.numel``.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> t = {"w": torch.arange(6.0).reshape(2, 3), "n": {"i": torch.tensor([7, 8])}}
        >>> vec, spec = T.flatten(t)
        >>> back = T.unflatten(vec * 2, spec)
        >>> back["w"]
        tensor([[ 0.,  2.,  4.],
                [ 6.,  8., 10.]])
        >>> back["n"]["i"]
        tensor([14, 16])
    """
    if not isinstance(spec, TreeSpec):
        raise TypeError(f"spec must be a TreeSpec; got {type(spec).__name__}")
    if not isinstance(vector, Tensor):
        raise TypeError(f"vector must be a Tensor; got {type(vector).__name__}")
    if vector.dim() != 1:
        raise ValueError(f"vector must be 1-D with {spec.numel} elements; got {vector.dim()}-D shape {tuple(vector.shape)}")
    if vector.numel() != spec.numel:
        raise ValueError(f"vector has {vector.numel()} elements but the spec needs {spec.numel}")
    if vector.is_complex():
        _refuse_imaginary(vector, spec)
    made: dict[str, Tensor] = {}
    for e in spec.entries:
        if e.alias_of is not None:
            made[e.path] = made[e.alias_of]
        else:
            part = vector[e.offset : e.offset + e.numel]
            if part.is_complex() and not e.dtype.is_complex:
                part = part.real  # (zero imaginary part: checked)
            made[e.path] = part.view(e.shape).to(e.dtype)
    if spec.skeleton is not None:
        return _rebuild(spec.skeleton, made)
    return made if spec.flat else from_flat_dict(made)


def _refuse_imaginary(vector: Tensor, spec: TreeSpec) -> None:
    """``TypeError`` when a real leaf's elements of the complex ``vector`` have a non-zero
    imaginary part (the cast would drop it; a vector ``flatten`` made of a tree mixing
    complex and real leaves has none there until it is changed)."""
    real = [e for e in spec.entries
            if e.alias_of is None and not e.dtype.is_complex and e.numel]
    if not real:
        return
    imaginary = torch.stack([vector[e.offset : e.offset + e.numel].imag.any() for e in real])
    if bool(imaginary.any()):  # (one read of the device)
        e = real[int(imaginary.nonzero()[0, 0])]
        raise TypeError(
            f"unflatten: the vector is complex ({vector.dtype}) and its elements for the leaf "
            f"at {e.path!r} ({e.dtype}) have a non-zero imaginary part: the cast would drop it")


def from_module(model: nn.Module, *, buffers: bool = False) -> Tree:
    """All parameters of ``model`` as a tree (the Parameter objects themselves).

    Paths are those of ``model.named_parameters()``; a tied parameter appears
    once, at its first path in that order.

    Arguments:
        model: an ``nn.Module``.
        buffers: also include the buffers (``named_buffers()``), each module's after its
            parameters; a tensor already present is not repeated.

    Returns:
        A tree of ``nn.Parameter`` (and buffer) objects.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``buffers`` not a bool.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> lin = torch.nn.Linear(2, 2)
        >>> model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)
        >>> T.paths(T.from_module(model))
        ['0.weight', '0.bias']
        >>> T.from_module(model)["0"]["weight"] is lin.weight
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    check_bool(buffers, "buffers", "tree.from_module")
    pairs = list(model.named_parameters())
    if buffers:
        seen = {id(p) for _, p in pairs}
        pairs += [(path, b) for path, b in model.named_buffers() if id(b) not in seen]
        # each module's buffers right after its parameters (named_modules order; a stable
        # sort keeps named_parameters' order among the parameters)
        order = {path: i for i, (path, _) in enumerate(model.named_modules())}
        pairs.sort(key=lambda pair: order.get(pair[0].rpartition(".")[0], len(order)))
    return from_flat_dict(pairs)


def to_flat_dict(tree: Tree) -> dict[str, Tensor]:
    """The leaves of ``tree`` keyed by dotted path, in tree order.

    Arguments:
        tree: a nested dict of tensors; ``None`` leaves are skipped.

    Returns:
        A ``dict[str, Tensor]`` (a tied tensor under each of its paths).

    Raises:
        TypeError, ValueError: as :func:`paths`.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> list(T.to_flat_dict({"a": {"b": torch.ones(1), "c": torch.ones(2)}}))
        ['a.b', 'a.c']
    """
    return dict(_walk(tree))


def from_flat_dict(flat: Mapping[str, Tensor | None] | Iterable[tuple[str, Tensor | None]]) -> Tree:
    """Build a tree from dotted paths; the inverse of :func:`to_flat_dict`.

    Arguments:
        flat: a mapping ``path -> Tensor`` or any iterable of ``(path, value)``
            pairs. ``None`` values are absent and skipped.

    Returns:
        A new nested dict, keys in first-seen order.

    Raises:
        ValueError: a path is not a string, has an empty component
            (``"a..b"``), appears twice, or conflicts with another
            (``"a"`` and ``"a.b"``: both are named).
        TypeError: ``flat`` is neither a mapping nor an iterable of pairs (None, a string,
            a tensor), an item is not a ``(path, value)`` pair, or a value is neither Tensor
            nor None.

    Example:
        >>> import torch
        >>> from torchstruct import tree as T
        >>> t = T.from_flat_dict({"enc.w": torch.ones(1), "enc.b": torch.zeros(1), "head": torch.ones(2)})
        >>> list(t), list(t["enc"])
        (['enc', 'head'], ['w', 'b'])
    """
    if isinstance(flat, (str, bytes, Tensor)) or not isinstance(flat, (Mapping, Iterable)):
        raise TypeError(
            "from_flat_dict: flat must be a mapping {path: tensor} or an iterable of "
            f"(path, tensor) pairs; got {type(flat).__name__}"
        )
    root: Tree = {}
    items = flat.items() if isinstance(flat, Mapping) else flat
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(
                f"from_flat_dict: item {i} must be a (path, tensor) pair; got "
                f"{type(item).__name__}"
            )
        _insert(root, *item)
    return root
