"""The one reader of manifests' encoded state trees.

A manifest's tree (see :mod:`ckstore.format.manifest` for the tags) comes from the catalog, so
it is untrusted. Every reader of a tree goes through this module:

* :func:`check_tree` validates a whole tree once, when its manifest is parsed: known tags,
  payloads of the right JSON type, dict keys that are scalar key nodes and distinct within their
  dict, tensor references in range and each used exactly once, and nesting no deeper than
  :data:`MAX_DEPTH`. It walks with an explicit stack, so no tree can exhaust Python's recursion.
* :func:`nodes` yields every node in pre-order with its key path: what diffs, tree comparisons
  and the tensor-path index read.
* :func:`rebuild` folds a tree back into Python containers, calling ``leaf`` for every non-container
  node (tensors, scalars, pickles): what checkout uses.

:func:`check_tree` and :func:`rebuild` first try a walk without key paths, which only accepts
exact JSON types and gives up at the first doubt (``rebuild``'s recurses, and gives up past
:data:`MAX_DEPTH` levels); the walk with key paths then decides, and its errors are the ones
raised. The rules are the same either way.

The walkers raise :class:`IntegrityError` on a malformed node even for a tree that skipped
:func:`check_tree`, but only :func:`check_tree` enforces the tensor and duplicate-key rules.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import IntegrityError

__all__ = [
    "MAX_DEPTH",
    "CONTAINER_TAGS",
    "SCALAR_TAGS",
    "KEY_TAGS",
    "check_tree",
    "decode_key",
    "decode_scalar",
    "nodes",
    "rebuild",
    "tree_difference",
    "tensor_paths",
]

#: The deepest nesting of dicts, lists and tuples a state tree may have (the root is depth 0).
#: Commits refuse deeper trees before writing anything; decoding refuses deeper manifests.
MAX_DEPTH = 100

CONTAINER_TAGS = frozenset("dlt")
SCALAR_TAGS = frozenset("nbifsy")
KEY_TAGS = frozenset("nbifs")  # the scalar types a dict key may have


def _bad(where: str, keys: tuple[Any, ...], why: str) -> IntegrityError:
    at = "/".join(str(k) for k in keys) if keys else "<root>"
    return IntegrityError(f"{where}manifest tree is malformed at key {at!r}: {why}")


def _tag(node: Any, where: str, keys: tuple[Any, ...]) -> str:
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise _bad(where, keys, f"a node must be a tagged JSON array, got {_short(node)}")
    return node[0]


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _float(text: Any, where: str, keys: tuple[Any, ...]) -> float:
    if not isinstance(text, str) or len(text) > 64:
        raise _bad(where, keys, f"a float node holds {_short(text)}, not its repr")
    try:
        return float(text)
    except ValueError:
        raise _bad(where, keys, f"a float node holds {_short(text)}, not its repr") from None


def decode_scalar(node: Any, where: str = "", keys: tuple[Any, ...] = ()) -> Any:
    """The Python value of a scalar node (``n b i f s y``)."""
    tag = _tag(node, where, keys)
    if tag not in SCALAR_TAGS:
        raise _bad(where, keys, f"unknown scalar node {tag!r}")
    if len(node) != (1 if tag == "n" else 2):
        raise _bad(where, keys, f"node {tag!r} has {len(node) - 1} payloads")
    if tag == "n":
        return None
    x = node[1]
    if tag == "b" and isinstance(x, bool):
        return x
    if tag == "i" and isinstance(x, int) and not isinstance(x, bool):
        return x
    if tag == "f":
        return _float(x, where, keys)
    if tag == "s" and isinstance(x, str):
        return x
    if tag == "y" and isinstance(x, str):
        try:
            return base64.b64decode(x, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(where, keys, "a bytes node is not valid base64") from None
    raise _bad(where, keys, f"node {tag!r} holds {_short(x)}")


def decode_key(node: Any, where: str = "", keys: tuple[Any, ...] = ()) -> Any:
    """The Python value of a dict key node (``n b i f s``)."""
    tag = _tag(node, where, keys)
    if tag not in KEY_TAGS:
        raise _bad(where, keys, f"a dict key must be None, bool, int, float or str, got node {tag!r}")
    return decode_scalar(node, where, keys)


def _children(node: list[Any], tag: str, where: str, keys: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(key, child)`` pairs of a container node, in order."""
    if len(node) != 2 or not isinstance(node[1], list):
        raise _bad(where, keys, f"container node {tag!r} must hold one JSON array")
    items = node[1]
    if tag != "d":
        return list(enumerate(items))
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 2:
            raise _bad(where, keys, "a dict item must be a [key, value] pair")
        out.append((decode_key(item[0], where, keys), item[1]))
    return out


def _check_leaf(node: list[Any], tag: str, where: str, keys: tuple[Any, ...]) -> None:
    if tag == "T" or tag == "P":
        if len(node) != 2:
            raise _bad(where, keys, f"node {tag!r} must hold one payload")
        if tag == "P" and not isinstance(node[1], str):
            raise _bad(where, keys, "a pickle node must hold base64 text")
        if tag == "T" and (not isinstance(node[1], int) or isinstance(node[1], bool)):
            raise _bad(where, keys, f"a tensor node holds {_short(node[1])}, not a tensor index")
        return
    decode_scalar(node, where, keys)


def nodes(tree: Any, where: str = "") -> Iterator[tuple[tuple[Any, ...], str, Any]]:
    """``(keys, tag, node)`` for every node of ``tree`` in pre-order (depth-first, in order).

    Containers come before their children. Raises :class:`IntegrityError` on a malformed node
    or on nesting deeper than :data:`MAX_DEPTH`.
    """
    stack: list[tuple[tuple[Any, ...], Any]] = [((), tree)]
    while stack:
        keys, node = stack.pop()
        if len(keys) > MAX_DEPTH:
            raise _bad(where, keys, f"nested deeper than {MAX_DEPTH} levels")
        tag = _tag(node, where, keys)
        if tag in CONTAINER_TAGS:
            children = _children(node, tag, where, keys)
            yield keys, tag, node
            stack.extend(((*keys, k), v) for k, v in reversed(children))
        else:
            if tag != "T" and tag != "P" and tag not in SCALAR_TAGS:
                raise _bad(where, keys, f"unknown node tag {tag!r}")
            _check_leaf(node, tag, where, keys)
            yield keys, tag, node


def check_tree(tree: Any, n_tensors: int, where: str = "") -> None:
    """Validate a whole encoded tree holding ``n_tensors`` tensor references.

    Raises :class:`IntegrityError` naming the key path of the first problem.
    """
    if _passes(tree, n_tensors):
        return
    seen = bytearray(n_tensors)
    for keys, tag, node in nodes(tree, where):
        if tag == "T":
            i = node[1]
            if not 0 <= i < n_tensors:
                raise _bad(where, keys, f"tensor {i} is not in the manifest's {n_tensors} tensors")
            if seen[i]:
                raise _bad(where, keys, f"tensor {i} is referenced twice")
            seen[i] = 1
        elif tag == "d":
            # keys equal in Python (1, 1.0 and True) would collapse into one when rebuilt;
            # NaN keys never compare equal, so any number of them survive
            dict_keys = [k for k, _ in _children(node, tag, where, keys) if not _is_nan(k)]
            if len(set(dict_keys)) != len(dict_keys):
                raise _bad(where, keys, "a dict holds the same key twice")
    if n_tensors and not all(seen):
        raise IntegrityError(f"{where}manifest lists tensor {seen.index(0)}, which its tree never references")


def _passes(tree: Any, n_tensors: int) -> bool:
    """True when ``tree`` keeps every rule :func:`check_tree` enforces, decided a node at a time
    with no key path per node (100,000 tensors: 45 against 142 ms); False when it may not, and
    :func:`check_tree`'s walk with key paths names the problem (or accepts what this is too
    strict for: only exact JSON types pass here)."""
    seen = bytearray(n_tensors)
    stack: list[tuple[Any, int]] = [(tree, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if type(node) is not list or not node or depth > MAX_DEPTH:
            return False
        tag = node[0]
        if tag == "T":
            i = node[1] if len(node) == 2 else None
            if type(i) is not int or not 0 <= i < n_tensors or seen[i]:
                return False
            seen[i] = 1
        elif tag == "d":
            if len(node) != 2 or type(node[1]) is not list:
                return False
            keys = []
            for item in node[1]:
                if type(item) is not list or len(item) != 2:
                    return False
                try:
                    key = _fast_key(item[0])
                except _Irregular:
                    return False
                if not _is_nan(key):
                    keys.append(key)
                push((item[1], depth + 1))
            if len(set(keys)) != len(keys):
                return False
        elif tag == "l" or tag == "t":
            if len(node) != 2 or type(node[1]) is not list:
                return False
            for child in node[1]:
                push((child, depth + 1))
        elif tag == "s":
            if len(node) != 2 or type(node[1]) is not str:
                return False
        elif tag == "i":
            if len(node) != 2 or type(node[1]) is not int:
                return False
        elif tag == "n":
            if len(node) != 1:
                return False
        elif type(tag) is str and tag in _OTHER_LEAVES:
            try:
                _check_leaf(node, tag, "", ())
            except IntegrityError:
                return False
        else:
            return False
    return n_tensors == 0 or all(seen)


#: the leaf tags :func:`_passes` and :func:`_plain` leave to the general checks
_OTHER_LEAVES = frozenset("bfyP")


class _Irregular(Exception):
    """A node the walks without key paths leave to the walks with them."""


def _fast_key(k: Any) -> Any:
    """A dict key node's value for the walks without key paths: a str or an int key (an
    optimizer's state is keyed by ints) straight from its payload, any other as
    :func:`decode_key` decodes it; :class:`_Irregular` where that refuses it."""
    if type(k) is list and len(k) == 2:
        tag, value = k
        if (tag == "s" and type(value) is str) or (tag == "i" and type(value) is int):
            return value
    try:
        return decode_key(k)
    except IntegrityError:
        raise _Irregular from None


def _is_nan(k: Any) -> bool:
    return isinstance(k, float) and math.isnan(k)


def tensor_paths(tree: Any, where: str = "") -> dict[int, tuple[Any, ...]]:
    """Map each tensor index in an encoded tree to its key path."""
    return {int(node[1]): keys for keys, tag, node in nodes(tree, where) if tag == "T"}


def rebuild(
    tree: Any,
    leaf: Callable[[tuple[Any, ...], str, Any], Any],
    where: str = "",
    *,
    tensor: Callable[[int], Any] | None = None,
) -> Any:
    """Rebuild Python containers from ``tree``; ``leaf(keys, tag, node)`` makes every other value.

    ``tensor``: what ``leaf`` returns for a tensor node ``["T", i]``, as ``tensor(i)``, and
    ``leaf`` returns the scalars :func:`decode_scalar` decodes. A tree of containers, tensors
    and scalars (no pickles) is then rebuilt without key paths (7,200 tensors: 4 against 21
    ms); any other goes through ``leaf``, from the start."""
    if tensor is not None:
        try:
            return _plain(tree, 0, tensor)
        except _Irregular:
            pass
    # each open container: (tag, list of built children, keys of its children, remaining count)
    root: list[Any] = []
    open_: list[tuple[str, list[Any], list[Any], list[int]]] = [("l", root, [], [1])]

    def close_finished() -> None:
        while len(open_) > 1 and open_[-1][3][0] == 0:
            tag, values, child_keys, _ = open_.pop()
            if tag == "d":
                built: Any = dict(zip(child_keys, values))
            elif tag == "l":
                built = values
            else:
                built = tuple(values)
            _put(built)

    def _put(value: Any) -> None:
        parent = open_[-1]
        parent[1].append(value)
        parent[3][0] -= 1

    for keys, tag, node in nodes(tree, where):
        if tag in CONTAINER_TAGS:
            children = _children(node, tag, where, keys)
            open_.append((tag, [], [k for k, _ in children], [len(children)]))
        else:
            _put(leaf(keys, tag, node))
        close_finished()
    return root[0]


def _plain(node: Any, depth: int, tensor: Callable[[int], Any]) -> Any:
    if type(node) is not list or not node or depth > MAX_DEPTH:
        raise _Irregular
    tag = node[0]
    n = len(node)
    if tag == "T":
        if n == 2 and type(node[1]) is int:
            return tensor(node[1])
    elif tag == "d":
        if n == 2 and type(node[1]) is list:
            out = {}
            for item in node[1]:
                if type(item) is not list or len(item) != 2:
                    raise _Irregular
                key = _fast_key(item[0])
                out[key] = _plain(item[1], depth + 1, tensor)
            return out
    elif tag == "l" or tag == "t":
        if n == 2 and type(node[1]) is list:
            items = [_plain(child, depth + 1, tensor) for child in node[1]]
            return items if tag == "l" else tuple(items)
    elif tag == "s" or tag == "i":
        if n == 2 and type(node[1]) is (str if tag == "s" else int):
            return node[1]
    elif tag == "n":
        if n == 1:
            return None
    elif tag == "b" or tag == "f" or tag == "y":
        try:
            return decode_scalar(node)
        except IntegrityError:
            raise _Irregular from None
    raise _Irregular


def _events(tree: Any, where: str) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Pre-order ``(keys, signature)``: a container's tag and encoded keys or length, a leaf's node."""
    for keys, tag, node in nodes(tree, where):
        if tag == "d":
            yield keys, ("d", [item[0] for item in node[1]])
        elif tag in CONTAINER_TAGS:
            yield keys, (tag, len(node[1]))
        else:
            yield keys, node


def tree_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The key path of the first difference between two encoded trees, or None when equal."""
    if a == b:
        return None
    sentinel = ((), None)
    ia, ib = _events(a, where), _events(b, where)
    while True:
        ea, eb = next(ia, sentinel), next(ib, sentinel)
        if ea != eb:
            keys = ea[0] if ea is not sentinel else eb[0]
            return "/".join(str(k) for k in keys) if keys else "<root>"
        if ea is sentinel:
            return None
