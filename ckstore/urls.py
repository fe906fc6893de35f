"""Catalog URLs: the one place that checks, expands, records and prints them.

Every URL is parsed with SQLAlchemy's own parser (``make_url``), never matched by a regex, so a
password holding ``/`` or ``@``, or one given as ``?password=`` in the query string, is seen for
what it is.

Two kinds of URL, two rules for ``$VAR`` / ``${VAR}`` references:

* a URL **given by the user** (``catalog=``, ``--catalog``, ``CKSTORE_CATALOG``) is trusted: every
  reference is replaced from the environment (:func:`expand_given`);
* a URL **read from a store's** ``ckstore.json`` was written by whoever can write the store (a
  shared bucket): it may refer to environment variables only as its whole password component, and
  only to ``PGPASSWORD`` or a name starting with ``CKSTORE_`` (:func:`expand_stored`). Anything
  else is refused, so a hostile config cannot send other variables (cloud keys, tokens) to a server
  of its choosing. libpq reads ``PGPASSWORD``, ``~/.pgpass`` and ``PGSERVICE`` by itself.

A URL recorded in a store must pass the second rule already when the store is created
(:func:`check_storable`), and never holds a literal password.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from .errors import StoreConfigError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = [
    "parse",
    "redact",
    "scrub",
    "check_no_secret",
    "check_storable",
    "expand_given",
    "expand_stored",
    "stored_variable_allowed",
]

#: query parameters libpq reads a secret from
SECRET_QUERY_KEYS = frozenset({"password", "sslpassword"})

_WHOLE_REF = re.compile(r"^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))$")
_ANY_REF = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_MASK = "***"
_PLACEHOLDER = "CKSTOREREDACTEDSECRET"
_HINT = (
    "refer to an environment variable instead (postgresql+psycopg://user:${PGPASSWORD}@host/db) "
    "or leave the password out and use ~/.pgpass or PGPASSWORD"
)


def stored_variable_allowed(name: str) -> bool:
    """Whether a URL read from a store may refer to environment variable ``name``."""
    return name == "PGPASSWORD" or name.startswith("CKSTORE_")


def parse(url: str) -> URL:
    """``url`` parsed by SQLAlchemy; a :class:`StoreConfigError` (showing it redacted) if it is not
    a URL."""
    from sqlalchemy.engine import make_url  # on first use: the CLI's --help needs no SQLAlchemy

    try:
        return make_url(url)
    except Exception as e:  # noqa: BLE001 - ArgumentError, or ValueError for a bad port
        raise StoreConfigError(
            f"the catalog URL {redact(url)} is not a valid SQLAlchemy URL "
            f"(dialect+driver://user:password@host:port/database): {type(e).__name__}"
        ) from None


def _secret_query_keys(url: URL) -> list[str]:
    return [k for k in url.query if k.lower() in SECRET_QUERY_KEYS]


def redact(url: str) -> str:
    """``url`` with its password and any ``?password=`` / ``?sslpassword=`` value hidden, for
    messages and logs. A string SQLAlchemy cannot parse is masked by pattern instead."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
        if "@" in (parsed.host or ""):  # a password with a bare "@": part of it landed in the host
            raise ValueError(url)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses; mask what looks secret
        return _mask_by_pattern(_WHOLE_USERINFO.sub(rf"\g<1>{_MASK}@", url))
    keys = _secret_query_keys(parsed)
    if keys:
        parsed = parsed.update_query_dict({k: _PLACEHOLDER for k in keys})
    return parsed.render_as_string(hide_password=True).replace(_PLACEHOLDER, _MASK)


_WHOLE_USERINFO = re.compile(r"^([^:/]*://[^/@:?#]*:).*@", re.DOTALL)  # one URL: up to its last "@"
_USERINFO = re.compile(r"(://[^/@\s:?#]*:)[^\s]*@")
# a value masked already keeps the punctuation after it ("?password=***: timeout")
_QUERY_SECRET = re.compile(
    r"((?:^|[?&;\s])(?:ssl)?password=)(?:\*\*\*(?=[.,:;!?]*(?:[&;\s]|$))|[^&;\s]*)", re.IGNORECASE
)


def _mask_by_pattern(text: str) -> str:
    return _QUERY_SECRET.sub(rf"\g<1>{_MASK}", _USERINFO.sub(rf"\g<1>{_MASK}@", text))


# a URL in a message: never its closing punctuation ("failed at URL: ...", "URL, then")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()\[\]]*[^\s'\"<>()\[\].,:;!?]")


def scrub(text: str) -> str:
    """``text`` (an error message, say) with every URL in it that carries a secret redacted."""

    def one(m: re.Match[str]) -> str:
        u = m.group(0)
        return redact(u) if ("@" in u or "password" in u.lower()) else u

    return _mask_by_pattern(_URL_IN_TEXT.sub(one, text))


def check_no_secret(url: str, where: str | None = None) -> None:
    """Refuse a URL with a literal password: in its password component (where a whole
    ``${VAR}`` reference is fine) or in its query string (``?password=``, ``?sslpassword=``).
    ``where``: the store whose config recorded the URL (None: a URL about to be recorded)."""
    parsed = parse(url)
    keys = _secret_query_keys(parsed)
    password = parsed.password
    if keys:
        what = f"a password in its query string (?{keys[0]}=)"
    elif password and not _WHOLE_REF.match(password):
        what = "a literal password"
    else:
        return
    if where is None:
        raise StoreConfigError(
            f"the catalog URL {redact(url)} holds {what}, which ckstore would write into the store's "
            f"config; {_HINT}"
        )
    raise StoreConfigError(
        f"the catalog URL recorded in {where} holds {what}; a store's config must not hold secrets. "
        "Pass the catalog URL yourself with --catalog or CKSTORE_CATALOG (catalog= in Python)"
    )


def check_storable(url: str) -> None:
    """Refuse a URL a store cannot record: one with a literal password, or one whose environment
    references :func:`expand_stored` would refuse when the store is opened again."""
    check_no_secret(url)
    _stored_reference(url, None)


def _stored_reference(url: str, where: str | None) -> tuple[URL, str | None]:
    """The parsed URL and the variable its password names (None: no reference), refusing every
    other reference."""
    parsed = parse(url)
    for component, value in _components(parsed):
        m = _ANY_REF.search(value)
        if m:
            raise _refused(m.group(1) or m.group(2), f"in its {component}", where)
    password = parsed.password
    if not password or "$" not in password:
        return parsed, None
    m = _WHOLE_REF.match(password)
    if m is None:  # pragma: no cover - check_no_secret refused it first
        raise StoreConfigError(f"the catalog URL's password must be one environment reference; {_HINT}")
    name = m.group(1) or m.group(2)
    if not stored_variable_allowed(name):
        raise _refused(name, "as its password", where)
    return parsed, name


def _components(url: URL) -> list[tuple[str, str]]:
    out = [("dialect", url.drivername), ("user name", url.username or ""), ("host", url.host or "")]
    out += [("database", url.database or ""), ("port", str(url.port or ""))]
    for k, v in url.query.items():
        out.append(("query string", k))
        out += [("query string", x) for x in ((v,) if isinstance(v, str) else v)]
    return out


def _refused(name: str, position: str, where: str | None) -> StoreConfigError:
    origin = f"recorded in {where}" if where else "to record in the store's config"
    return StoreConfigError(
        f"the catalog URL {origin} refers to the environment variable {name} {position}; a URL "
        "read from a store may refer only to PGPASSWORD or CKSTORE_* variables, and only as its "
        "whole password, so that whoever can write the store cannot send your environment to a "
        "server of theirs. Pass the catalog URL yourself with --catalog or CKSTORE_CATALOG "
        "(catalog= in Python)"
    )


def _unset(name: str) -> StoreConfigError:
    return StoreConfigError(
        f"the catalog URL refers to the environment variable {name}, which is not set; "
        "set it (or pass another catalog URL with --catalog / catalog=)"
    )


def expand_given(url: str) -> str:
    """A URL the user gave, with every ``$VAR`` / ``${VAR}`` replaced from the environment; an
    unset one is an error.

    The URL is parsed with its references in place and each component expanded on its own, so a
    value holding ``@``, ``:`` or ``/`` (a password) stays in its component. A URL that does not
    parse until expanded (a reference as its port, or as the whole URL) is expanded as text."""
    missing = [a or b for a, b in _ANY_REF.findall(url) if (a or b) not in os.environ]
    if missing:
        raise _unset(missing[0])
    if not _ANY_REF.search(url):
        return url
    try:
        parsed = parse(url)
    except StoreConfigError:
        return os.path.expandvars(url)
    return parsed.set(
        username=_expand(parsed.username),
        password=_expand(parsed.password),
        host=_expand(parsed.host),
        database=_expand(parsed.database),
        query={
            os.path.expandvars(k): os.path.expandvars(v) if isinstance(v, str) else tuple(os.path.expandvars(x) for x in v)
            for k, v in parsed.query.items()
        },
    ).render_as_string(hide_password=False)


def _expand(value: str | None) -> str | None:
    return None if value is None else os.path.expandvars(value)


def expand_stored(url: str, where: str) -> str:
    """A URL read from the config of the store at ``where``, expanded under the stored-URL rule
    (module docstring): a :class:`StoreConfigError` naming ``--catalog`` for anything else."""
    check_no_secret(url, where)
    parsed, name = _stored_reference(url, where)
    if name is None:
        return url
    value = os.environ.get(name)
    if value is None:
        raise _unset(name)
    return parsed.set(password=value).render_as_string(hide_password=False)
