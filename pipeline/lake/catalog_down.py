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

__all__ = ["said", "redact", "where"]

#: Words of a PostgreSQL server that is down, unreachable or gone mid-statement.
_DOWN = (
    "Unable to connect to Postgres", "server closed the connection", "Connection refused",
    "could not connect to server", "connection to server at", "Attempting to fetch from an unsuccessful query result",
    "terminating connection due to administrator command", "no connection to the server", "SSL SYSCALL error",
    "the database system is shutting down", "the database system is starting up", "could not translate host name",
    "Connection timed out", "No route to host",
)
_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(postgres(?:ql)?(?:\+\w+)?://[^:/@\s]+:)([^@\s]+)(@)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every PostgreSQL password in it (libpq ``password=...``, a URL's) as ``***``."""
    return _URL_PASSWORD.sub(r"\1***\3", _PASSWORD.sub(r"\1***", text))


def where(catalog: str | None = None) -> str:
    """The PostgreSQL catalog's server and database, from ``FEATUREHOUSE_CATALOG``'s libpq
    string (``postgres:dbname=... host=... port=...``); no password."""
    catalog = catalog if catalog is not None else os.environ.get("FEATUREHOUSE_CATALOG", "")
    pairs = dict(re.findall(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", catalog.removeprefix("postgres:")))
    host = pairs.get("host", "localhost").strip("'")
    port = pairs.get("port", "5432").strip("'")
    db = pairs.get("dbname", "").strip("'")
    return f"{host}:{port}" + (f", database {db}" if db else "")


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


def said(exc: BaseException, catalog: str | None = None) -> str | None:
    """One line for an exception (or one in its chain) that says the PostgreSQL catalog does
    not answer; None for any other."""
    catalog = catalog if catalog is not None else os.environ.get("FEATUREHOUSE_CATALOG", "")
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        names = {t.__module__.split(".")[0] for t in type(e).__mro__}
        if ({"duckdb", "_duckdb", "psycopg", "psycopg2"} & names or isinstance(e, ConnectionError)) and (
                any(words in text for words in _DOWN) and ("Postgres" in text or catalog.startswith("postgres:")
                                                           or "psycopg" in names)):
            return (f"the warehouse's PostgreSQL catalog ({where(catalog) if catalog.startswith('postgres:') else 'FEATUREHOUSE_CATALOG'}) "
                    f"does not answer: {redact(_reason(text))}. Start PostgreSQL (or correct FEATUREHOUSE_CATALOG) and "
                    "run the command again; a load commits in one transaction, so nothing half-done was committed")
        e = e.__cause__ or e.__context__
    # A statement cut off by the server's end can fail in words of its own ("Failed to commit:
    # Failed to execute query \"ROLLBACK\": "): ask the server itself.
    names = {t.__module__.split(".")[0] for t in type(exc).__mro__}
    if catalog.startswith("postgres:") and {"duckdb", "_duckdb"} & names:
        down = _probe(catalog)
        if down is not None:
            return (f"the warehouse's PostgreSQL catalog ({where(catalog)}) stopped answering ({redact(down)}) "
                    "during the command. Start PostgreSQL and run the command again; a load commits in one "
                    "transaction, so nothing half-done was committed")
    return None


def _probe(catalog: str) -> str | None:
    """Why the catalog's server does not take a connection now (within 3 s), or None if it does."""
    try:
        import psycopg
    except ImportError:
        return None
    try:
        psycopg.connect(catalog.removeprefix("postgres:"), connect_timeout=3).close()
    except psycopg.Error as exc:
        return _reason(str(exc))
    return None
