"""A PostgreSQL catalog that does not answer, said in one line a person can act on.

DuckDB's postgres extension and psycopg say it in many ways ("Unable to connect to Postgres
at ...", "server closed the connection unexpectedly", "Attempting to fetch from an unsuccessful
query result" when the server stops in the middle of a statement), with a traceback, and the
first of them echoes the libpq string, password included. :func:`said` recognises them anywhere
in an exception's chain and gives one line naming the server (never its password) and what to
do; :func:`redact` takes a password out of any text.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qs, unquote, urlsplit

from ..config import postgres_catalog, without_password

__all__ = ["said", "redact", "where", "probe"]

#: Words of a PostgreSQL server that is down, unreachable or gone mid-statement.
_DOWN = (
    "Unable to connect to Postgres", "server closed the connection", "Connection refused",
    "could not connect to server", "connection to server at", "Attempting to fetch from an unsuccessful query result",
    "terminating connection due to administrator command", "no connection to the server", "SSL SYSCALL error",
    "the database system is shutting down", "the database system is starting up", "could not translate host name",
    "Connection timed out", "No route to host",
)


def redact(text: str) -> str:
    """``text`` with every PostgreSQL password in it (libpq ``password=...``, a URL's) as ``***``."""
    return without_password(text)


def _catalog(catalog: str | None) -> str:
    """``catalog`` (else ``$FEATUREHOUSE_CATALOG``) as Settings.catalog_url has it: a PostgreSQL
    one always ``postgres:`` and a libpq string or URL."""
    catalog = catalog if catalog is not None else (os.environ.get("FEATUREHOUSE_CATALOG") or "").strip()
    return postgres_catalog(catalog)


def _is_postgres(catalog: str) -> bool:
    return catalog.startswith("postgres:")


def where(catalog: str | None = None) -> str:
    """The PostgreSQL catalog's server and database (``host:port, database db``), from
    ``FEATUREHOUSE_CATALOG``'s libpq string (``postgres:dbname=... host=... port=...``) or URL
    (``postgres:postgresql://user:pw@host:port/db``, or the URL alone); never its password."""
    dsn = _catalog(catalog).removeprefix("postgres:")
    if re.match(r"postgres(?:ql)?://", dsn, re.IGNORECASE):
        try:
            url = urlsplit(dsn)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            netloc = url.netloc.rsplit("@", 1)[-1]
            host, port = (netloc.rsplit(":", 1) if re.search(r":\d*$", netloc) else (netloc, ""))
            host = unquote(host) or query.get("host", "localhost")
            port = port or query.get("port", "5432")
            db = unquote(url.path.lstrip("/")) or query.get("dbname", "")
        except ValueError:  # not a URL urllib can read: the server is not named, nor the password
            return "the server FEATUREHOUSE_CATALOG names"
    else:
        pairs = dict(re.findall(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn))
        host = pairs.get("host", "localhost").strip("'")
        port = pairs.get("port", "5432").strip("'")
        db = pairs.get("dbname", "").strip("'")
    return redact(f"{host}:{port}" + (f", database {db}" if db else ""))


def _reason(text: str) -> str:
    if "Attempting to fetch from an unsuccessful query result" in text or "server closed the connection" in text:
        return "it stopped answering in the middle of a statement"
    found = re.findall(r"failed: ([^\n\"]+)", text)
    if found and found[-1].strip():
        return found[-1].strip().rstrip(".")
    for words in _DOWN:
        if words in text:
            return words[0].lower() + words[1:]
    return "it does not answer"


#: What a command says to do once PostgreSQL answers again (``said``'s ``again``).
AGAIN = "run the command again; a load commits in one transaction, so nothing half-done was committed"


def said(exc: BaseException, catalog: str | None = None, *, again: str = AGAIN) -> str | None:
    """One line for an exception (or one in its chain) that says the PostgreSQL catalog does
    not answer; None for any other. ``again``: what to do once it answers (a command's words
    by default; the web app says to reload the page)."""
    catalog = _catalog(catalog)
    postgres = _is_postgres(catalog)
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        names = {t.__module__.split(".")[0] for t in type(e).__mro__}
        if ({"duckdb", "_duckdb", "psycopg", "psycopg2"} & names or isinstance(e, ConnectionError)) and (
                any(words in text for words in _DOWN) and ("Postgres" in text or postgres or "psycopg" in names)):
            return (f"the warehouse's PostgreSQL catalog ({where(catalog) if postgres else 'FEATUREHOUSE_CATALOG'}) "
                    f"does not answer: {redact(_reason(text))}. Start PostgreSQL (or correct FEATUREHOUSE_CATALOG) "
                    f"and {again}")
        e = e.__cause__ or e.__context__
    # A statement cut off by the server's end can fail in words of its own ("Failed to commit:
    # Failed to execute query \"ROLLBACK\": "): ask the server itself.
    names = {t.__module__.split(".")[0] for t in type(exc).__mro__}
    if postgres and {"duckdb", "_duckdb"} & names:
        down = probe(catalog)
        if down is not None:
            return (f"the warehouse's PostgreSQL catalog ({where(catalog)}) stopped answering ({redact(down)}) "
                    f"during the command. Start PostgreSQL and {again}")
    return None


def probe(catalog: str | None = None) -> str | None:
    """Why the catalog's server does not take a connection now (within 3 s), or None if it does
    (or the catalog is not PostgreSQL's)."""
    catalog = _catalog(catalog)
    if not _is_postgres(catalog):
        return None
    try:
        import psycopg
    except ImportError:
        return None
    try:
        psycopg.connect(catalog.removeprefix("postgres:"), connect_timeout=3).close()
    except psycopg.Error as exc:
        return redact(_reason(str(exc)))
    return None


_probe = probe
