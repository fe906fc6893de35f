"""The package's layering rules, read from the source with ``ast``: one function per rule."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckstore"

#: modules only the catalog may import: SQL and the catalog's table-level internals
SQL_MODULES = ("sqlalchemy", "ckstore.catalog._schema", "ckstore.catalog._rows", "ckstore.catalog._queries")

#: SQLAlchemy's URL parser is not SQL: ckstore.urls parses catalog URLs with it (never a regex)
URL_PARSER = ("sqlalchemy.engine", "sqlalchemy.engine.URL", "sqlalchemy.engine.make_url")

#: the layers, bottom up: a module imports only its own package and lower layers; packages on
#: one layer do not import each other (commit, diff and maintenance stand side by side), except
#: the shared values of the first layer
LAYERS: tuple[tuple[str, ...], ...] = (
    # values every layer shares; kill points; shared worker threads; the garbage collector's pauses
    ("errors", "layout", "records", "refs", "urls", "config", "_crash", "_threads", "_collector"),
    ("blobstore", "catalog"),  # bytes under keys; SQL
    ("format",),  # frames, packs, manifests, the tree walker
    ("checkout",),  # shard resolution, read plans, the executor
    ("commit", "diff", "maintenance"),
    ("store",),
    ("opening",),
    ("integrations",),
    ("cli",),
    ("__main__", "retention", ""),  # the package root and its public re-exports
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in a module, ``from . import x`` and
    imports inside functions included (``from a import b`` yields ``a`` and ``a.b``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_imports_are_read_right() -> None:
    """The walker sees relative, aliased and function-level imports (else the rules prove nothing)."""
    found = set(imports(PACKAGE / "maintenance" / "gc.py"))
    assert any(name == "ckstore.catalog.Catalog" for _, name in found)
    assert any(name == "ckstore.maintenance.retention" for _, name in found)
    assert any(name == "sqlalchemy" for _, name in imports(PACKAGE / "catalog" / "_rows.py"))
    assert any(_is_within(name, "ckstore.maintenance.gc") for _, name in imports(PACKAGE / "store.py"))


def test_sql_stays_inside_the_catalog() -> None:
    """No module outside ``ckstore/catalog/`` imports SQLAlchemy or the catalog's table-level
    modules: the rest of ckstore calls the catalog's named methods."""
    catalog = PACKAGE / "catalog"
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in modules()
        if catalog not in path.parents
        for line, name in imports(path)
        if any(_is_within(name, banned) for banned in SQL_MODULES)
        and not (path == PACKAGE / "urls.py" and name in URL_PARSER)
    ]
    assert offenders == []


def _unit(module: str) -> str:
    """The layer unit of ``ckstore.X.Y``: ``X`` (``""`` for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rank(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"ckstore.{unit} is on no layer: add it to LAYERS in {Path(__file__).name}")


def test_no_module_imports_a_layer_above_it() -> None:
    offenders = []
    for path in modules():
        here = _unit(_module_name(path))
        for line, name in imports(path):
            if not _is_within(name, "ckstore") or name == "ckstore":
                continue
            there = _unit(name)
            if there != here and _rank(there) >= max(_rank(here), 1):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert offenders == []


def test_the_layer_rules_see_a_violation() -> None:
    """A lower layer importing a higher one is caught (else the rule above proves nothing)."""
    assert _rank(_unit("ckstore.format.codec")) < _rank(_unit("ckstore.store"))
    assert _rank(_unit("ckstore.commit.protocol")) == _rank(_unit("ckstore.maintenance.gc"))
    assert _unit("ckstore") == "" and _rank("") == len(LAYERS) - 1


def test_no_import_cycles_between_modules() -> None:
    """Module-level imports (including those under ``TYPE_CHECKING``) form no cycle."""
    names = {_module_name(p): p for p in modules()}
    graph: dict[str, set[str]] = {}
    for mod, path in names.items():
        deps = set()
        for _, name in imports(path):
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                deps.add(name)
        graph[mod] = deps
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(mod: str, trail: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append(trail[trail.index(dep):] + [dep] if dep in trail else [mod, dep])
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert cycles == []
