"""The package's layering rules, read from the source with ``ast``: one function per rule."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckstore"

#: modules only the catalog may import: SQL and the catalog's table-level internals
SQL_MODULES = ("sqlalchemy", "ckstore.catalog._schema", "ckstore.catalog._rows", "ckstore.catalog._queries")


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
    ]
    assert offenders == []
