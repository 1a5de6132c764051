"""Ad-hoc queries (`featurehouse sql`): reads only. A statement must be provably a read of the
warehouse (``check_read_only``), and it runs in a process that cannot write the lake
(``open_for_queries``: Landlock, and DuckDB's own sandbox)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

import duckdb
import orjson

from ..config import Settings
from .catalog import CATALOG, _sqlite_file
from .connect import connect, data_path, settings_for
from .extensions import new_connection as _duckdb
from .sqltext import _q

log = logging.getLogger("featurehouse")


# --- ad-hoc queries: reads only -------------------------------------------------------------------
#
# `featurehouse sql` runs what a user types. Two layers, each enough on its own for what it covers:
#
# 1. ``check_read_only``: the statement must be provably a read. DuckDB's own parser serializes
#    it (``json_serialize_sql`` takes SELECT trees only: COPY, ATTACH, SET, CALL, ... are not
#    one), and the tree is walked: every table it names is one of the warehouse's (or a CTE, or
#    a catalog view), every table function is on a short list. A text match cannot tell
#    ``query('... sqlite' || '_scan ...')`` from a read; the tree can (``query`` is not listed).
# 2. ``open_for_queries``: the process that runs the query cannot write files at all, except in
#    a private scratch folder (Linux Landlock, an unprivileged kernel sandbox), and DuckDB's own
#    file access is limited to the data folder and locked (``sandbox``). So a statement that
#    slipped past the check (``EXPLAIN ANALYZE COPY ... TO '<a data file>'``) fails to write.


class RefusedQuery(PermissionError):
    "The statement is not provably a read of the warehouse: `featurehouse sql` does not run it."


#: DuckLake's read-only functions of the warehouse's catalog: ``featurehouse.snapshots()`` (or
#: ``snapshots()`` once it is in use), and the same as ``ducklake_snapshots('featurehouse')``.
_LAKE_READS = ("snapshots", "current_snapshot", "last_committed_snapshot", "table_info", "table_changes",
               "table_insertions", "table_deletions", "options", "settings")

#: Table functions that only compute, or read the catalogs' descriptions: nothing else is run.
#: (Not ``query``/``query_table``/``read_*``/scanners, which read what they are given, nor
#: DuckLake's maintenance functions, which write.)
_TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "repeat", "repeat_row", "json_each", "json_tree", "glob",
    "duckdb_columns", "duckdb_constraints", "duckdb_databases", "duckdb_dependencies", "duckdb_extensions",
    "duckdb_functions", "duckdb_indexes", "duckdb_keywords", "duckdb_memory", "duckdb_optimizers",
    "duckdb_schemas", "duckdb_sequences", "duckdb_settings", "duckdb_tables", "duckdb_temporary_files",
    "duckdb_types", "duckdb_variables", "duckdb_views", "pragma_collations", "pragma_database_size",
    "pragma_platform", "pragma_show", "pragma_table_info", "pragma_version", "pragma_user_agent",
    "icu_calendar_names", "pg_timezone_names", "ducklake_list_files",
    *(f"ducklake_{name}" for name in _LAKE_READS),
})

def _plain_glob(fn: dict) -> bool:
    """Whether a glob() call takes one constant path with no ``..`` step in it."""
    args = fn.get("children") or []
    if len(args) != 1 or args[0].get("class") != "CONSTANT":
        return False
    value = args[0].get("value")
    text = value.get("value") if isinstance(value, dict) else None
    return isinstance(text, str) and ".." not in re.split(r"[/\\]", text)


#: Scalar functions with an effect beyond their result.
_SCALAR_REFUSED = frozenset({"write_log"})

#: ``SHOW TABLES`` / ``SHOW DATABASES`` / ``SHOW SCHEMAS`` (what DuckDB's binder expands itself).
_SHOW_LISTS = frozenset({'"tables"', "__show_tables_expanded", '"databases"', '"schemas"'})

#: Table references a read may hold; anything else (an unknown kind) is refused.
_TABLE_REFS = frozenset({"BASE_TABLE", "TABLE_FUNCTION", "SUBQUERY", "JOIN", "EXPRESSION_LIST", "EMPTY",
                         "EMPTY_FROM", "PIVOT", "SHOW_REF"})

READ_ONLY_HELP = (
    "featurehouse sql is read-only and runs queries only: SELECT / FROM / WITH / VALUES, PIVOT and UNPIVOT, "
    "DESCRIBE, SHOW, SUMMARIZE, and EXPLAIN [ANALYZE] of those, over the warehouse's tables (and CTEs, "
    "information_schema and the duckdb_* catalog views), with the table functions "
    f"{', '.join(n + '()' for n in _LAKE_READS)} (as {CATALOG}.<name>() or ducklake_<name>('{CATALOG}', ...)), "
    "range, generate_series, unnest, repeat, json_each, json_tree, glob and the duckdb_*/pragma_* listings; "
    "write results out with --format csv or --format json"
)


def _serialized_json(conn: duckdb.DuckDBPyConnection, sql: str) -> str:
    """DuckDB's ``json_serialize_sql`` of ``sql``: given as a literal, because a bound parameter
    makes DuckDB's Python client import pandas (0.5 s a command); a NUL, which no literal can
    hold, is bound (tests/test_sql_sandbox.py checks both parse the same for any text)."""
    if "\0" in sql:
        return conn.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0]
    return conn.execute(f"SELECT json_serialize_sql('{_q(sql)}')").fetchone()[0]


def _serialized(conn: duckdb.DuckDBPyConnection, sql: str) -> list[dict] | None:
    """The statements' trees from DuckDB's parser, or None when they are not all SELECTs."""
    tree = orjson.loads(_serialized_json(conn, sql))
    return None if tree.get("error") else tree["statements"]


def _relations(conn: duckdb.DuckDBPyConnection) -> set[tuple[str, str, str]]:
    """(database, schema, name) of every table and view attached: the warehouse's tables, its
    catalog's, and DuckDB's information_schema / pg_catalog / duckdb_* views."""
    rows = conn.execute("SELECT database_name, schema_name, table_name FROM duckdb_tables() UNION ALL "
                        "SELECT database_name, schema_name, view_name FROM duckdb_views()").fetchall()
    return {(d.lower(), s.lower(), n.lower()) for d, s, n in rows}


def _is_relation(known: set[tuple[str, str, str]], catalog: str, schema: str, name: str) -> bool:
    if catalog:
        return (catalog, schema or "main", name) in known
    if schema:  # schema.name, or catalog.name
        return any(s == schema and d in (CATALOG, "system", "temp") for d, s, n in known if n == name) \
            or (schema, "main", name) in known
    return any(d in (CATALOG, "system", "temp") and s in ("main", "pg_catalog") for d, s, n in known if n == name)


class _NoSuchTable(str):
    """A name that is no table of the warehouse: most often a typo, so the refusal names the
    nearest table (difflib) instead of the read-only rules, which are not what went wrong."""

    def __new__(cls, shown: str, known: set[tuple[str, str, str]]) -> _NoSuchTable:
        import difflib

        tables = sorted({n for d, s, n in known if d == CATALOG and s == "main"})
        near = difflib.get_close_matches(shown.split(".")[-1].lower(), tables, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        return super().__new__(cls, f"{shown!r}, which is not a table of the warehouse{hint} (SHOW TABLES lists "
                                    "them; a file name is read as a table name)")


def _refused_in(tree: Any, known: set[tuple[str, str, str]], ctes: frozenset[str] = frozenset()) -> str | None:
    """What in a serialized statement is not a read (a table function off the list, a name that
    is not a table, ...), or None."""
    if isinstance(tree, list):
        for item in tree:
            if found := _refused_in(item, known, ctes):
                return found
        return None
    if not isinstance(tree, dict):
        return None
    outer = ctes
    entries = tree["cte_map"].get("map", []) if isinstance(tree.get("cte_map"), dict) else []
    names = [entry["key"].lower() for entry in entries]
    ctes = ctes | set(names)
    kind = tree.get("type")
    if "class" in tree:  # an expression
        if tree["class"] == "FUNCTION" and tree.get("function_name", "").lower() in _SCALAR_REFUSED:
            return f"the function {tree['function_name']}()"
    elif "alias" in tree and "sample" in tree:  # a table reference
        if kind not in _TABLE_REFS:
            return f"a {kind} table reference"
        if kind == "TABLE_FUNCTION":
            fn = tree["function"]
            name = fn.get("function_name", "").lower()
            where = tuple(x.lower() for x in (fn.get("catalog", ""), fn.get("schema", "")) if x)
            if name in _LAKE_READS and where in ((), (CATALOG,), (CATALOG, "main")):
                pass
            elif name == "glob" and not _plain_glob(fn):
                # DuckDB's allowed_directories lets 'data/../catalog.sqlite' through in glob()
                return "glob() of anything but one constant path without '..' (it lists files in the data folder only)"
            elif name in _TABLE_FUNCTIONS and set(where) <= {"system", "main"}:
                pass
            else:
                return f"the table function {'.'.join((*where, name))}()"
        elif kind == "BASE_TABLE":
            catalog, schema, name = (tree.get(k, "").lower() for k in ("catalog_name", "schema_name", "table_name"))
            if not (catalog or schema) and name in ctes:
                pass
            elif not _is_relation(known, catalog, schema, name):
                shown = ".".join(x for x in (tree.get("catalog_name"), tree.get("schema_name"), tree.get("table_name")) if x)
                if "/" in name or "\\" in name or "." in name:  # a file's name: files are not read
                    return f"{shown!r}, which is not a table of the warehouse (a file name is read as one)"
                return _NoSuchTable(shown, known)
        elif kind == "SHOW_REF" and not tree.get("query") and tree.get("show_type") != "SHOW_FROM" \
                and tree.get("table_name") not in _SHOW_LISTS:
            return f"SHOW {tree.get('table_name')}"
    for key, value in tree.items():
        if key != "cte_map" and isinstance(value, (dict, list)):
            # a recursive CTE names itself in its recursive part only (its anchor, the left,
            # reads a table or file of that name)
            seen = ctes | {tree["cte_name"].lower()} if kind == "RECURSIVE_CTE_NODE" and key == "right" else ctes
            if found := _refused_in(value, known, seen):
                return found
    # The CTEs' own bodies, each seeing only the CTEs before it (and those of enclosing queries):
    # DuckDB binds a name a body gives to itself or to a later CTE as a table, or a file
    # (``WITH a AS (FROM 'x.csv'), "x.csv" AS (SELECT 1) FROM a`` reads x.csv).
    for i, entry in enumerate(entries):
        if found := _refused_in(entry.get("value"), known, outer | set(names[:i])):
            return found
    return None


def _words(sql: str) -> list[tuple[int, str]]:
    """DuckDB's tokens of ``sql`` (comments and strings skipped by its tokenizer): (offset,
    upper-cased keyword or identifier, or the operator's first character; '' for literals)."""
    out = []
    for offset, kind in duckdb.tokenize(sql):
        if kind in (duckdb.token_type.keyword, duckdb.token_type.identifier):
            m = re.match(r"[A-Za-z_][A-Za-z_0-9]*", sql[offset:])
            out.append((offset, m.group(0).upper() if m and kind == duckdb.token_type.keyword else "\0ident"))
        elif kind == duckdb.token_type.operator:
            out.append((offset, sql[offset]))
        else:
            out.append((offset, ""))
    return out


#: Where a PIVOT's ON list ends.
_PIVOT_ON_ENDS = frozenset({"USING", "GROUP", "ORDER", "LIMIT", "OFFSET", "UNION", "EXCEPT", "INTERSECT",
                            "HAVING", "QUALIFY", "WINDOW", ";"})


def _pivot_values_named(sql: str) -> tuple[str, int]:
    """``sql`` with ``IN (NULL)`` added to each PIVOT column without an IN list, and how many.

    A PIVOT without its values is, to DuckDB, a CREATE of an enum of them and then a SELECT,
    which the serializer refuses; with a list it is one SELECT tree holding the same source,
    columns and aggregates. The tree of this text is checked; the user's text is what runs.
    """
    inserts: list[int] = []
    states: list[dict] = []  # open PIVOTs: their depth, and whether in the ON list / its item has IN
    depth = 0

    def end_item(state: dict, at: int) -> None:
        if not state["has_in"]:
            inserts.append(at)
        state["has_in"] = False

    for offset, word in _words(sql):
        top = states[-1] if states and states[-1]["depth"] == depth else None
        if word == ")":
            if top is not None:
                if top["on"]:
                    end_item(top, offset)
                states.pop()
            depth -= 1
            continue
        if word == "(":
            depth += 1
        elif word == "PIVOT":
            states.append({"depth": depth, "on": False, "has_in": False})
        elif top is None:
            pass
        elif not top["on"]:
            if word == "ON":
                top["on"] = True
            elif word in ("JOIN", "SELECT", ";"):
                states.pop()  # not the ON of a PIVOT ... ON (a join's, or another form)
        elif word == "IN":
            top["has_in"] = True
        elif word == ",":
            end_item(top, offset)
        elif word in _PIVOT_ON_ENDS:
            end_item(top, offset)
            states.pop()
    for state in states:
        if state["on"]:
            end_item(state, len(sql))
    text = sql
    for at in sorted(inserts, reverse=True):
        text = text[:at] + "\n IN (NULL) " + text[at:]
    return text, len(inserts)


def _explained(sql: str) -> str:
    """What an EXPLAIN [ANALYZE] statement explains (and, with ANALYZE, runs)."""
    words = _words(sql)
    i = 1 if words and words[0][1] == "EXPLAIN" else 0
    if i and len(words) > 1 and words[1][1] in ("ANALYZE", "ANALYSE"):
        i = 2
    if i == 1 and i < len(words) and words[i][1] == "(":
        i = _explain_options_end(sql, words, i)
    if not i or i >= len(words) or words[i][1] == "(":
        raise RefusedQuery(f"refused an EXPLAIN with options other than ANALYZE and FORMAT "
                           f"{'|'.join(sorted(_EXPLAIN_FORMATS)).lower()}. {READ_ONLY_HELP}")
    return sql[words[i][0]:]


#: ``EXPLAIN (FORMAT f)``'s formats: each only changes how the plan is printed.
_EXPLAIN_FORMATS = frozenset({"TEXT", "JSON", "HTML", "GRAPHVIZ", "YAML", "MERMAID"})


def _explain_options_end(sql: str, words: list[tuple[int, str]], i: int) -> int:
    """The index of the first word after ``EXPLAIN (options)`` whose options are each ANALYZE or
    FORMAT with one of :data:`_EXPLAIN_FORMATS`; 0 for any other option list."""
    j = sql.find(")", words[i][0])
    if j < 0:
        return 0
    items = [item.split() for item in sql[words[i][0] + 1:j].split(",")]
    for item in items:
        item = [w.strip('"').upper() for w in item]
        if not (item in (["ANALYZE"], ["ANALYSE"]) or (len(item) == 2 and item[0] == "FORMAT"
                                                           and item[1] in _EXPLAIN_FORMATS)):
            return 0
    after = [k for k, (offset, _) in enumerate(words) if offset > j]
    return after[0] if after else 0


def check_read_only(conn: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise :class:`RefusedQuery`, saying what is allowed, unless every statement in ``sql`` is
    provably a read of the warehouse (see the section's comment). A statement DuckDB cannot
    parse raises its ``duckdb.Error``."""
    try:
        _check(conn, sql, _relations(conn), explain=True)
    except (RecursionError, orjson.JSONDecodeError):
        raise RefusedQuery(f"refused a statement nested too deeply to check. {READ_ONLY_HELP}") from None


def _check(conn: duckdb.DuckDBPyConnection, sql: str, known: set[tuple[str, str, str]], *, explain: bool) -> None:
    statements = duckdb.extract_statements(sql)
    if not statements:
        return
    trees = _serialized(conn, sql)
    if trees is None:
        made = [st for st in statements if not st.query.strip()]  # DuckDB's own, for a PIVOT
        if not made:
            if len(statements) > 1:
                for st in statements:
                    _check(conn, st.query, known, explain=explain)
                return
            (st,) = statements
            if st.type == duckdb.StatementType.EXPLAIN and explain:
                try:
                    _check(conn, _explained(st.query), known, explain=False)
                except RefusedQuery as exc:
                    raise RefusedQuery(str(exc).replace("refused ", "refused EXPLAIN of ", 1)) from None
                return
            raise RefusedQuery(f"refused a {st.type.name} statement. {READ_ONLY_HELP}")
        others = [st.type.name for st in statements if st.query.strip() and st.type != duckdb.StatementType.SELECT]
        if others or any(st.type not in (duckdb.StatementType.CREATE, duckdb.StatementType.SELECT) for st in made):
            raise RefusedQuery(f"refused a {(others or [made[0].type.name])[0]} statement. {READ_ONLY_HELP}")
        text, n = _pivot_values_named(sql)
        trees = _serialized(conn, text) if n else None
        if trees is None or n != sum(st.type == duckdb.StatementType.CREATE for st in made):
            raise RefusedQuery("refused a CREATE statement (write a PIVOT that DuckDB cannot read as a SELECT "
                               f"with its values: PIVOT ... ON col IN (...)). {READ_ONLY_HELP}")
    for tree in trees:
        if found := _refused_in(tree, known):
            raise RefusedQuery(f"refused {found}" if isinstance(found, _NoSuchTable) else
                               f"refused {found}. {READ_ONLY_HELP}")


# --- the process that runs them cannot write --------------------------------------------------------

_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every Linux ABI
_FS_READ = 1 << 0 | 1 << 2 | 1 << 3  # EXECUTE, READ_FILE, READ_DIR
_FS_FILE = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15  # what applies to a file (not a folder)


def confine_process(writable: list[Path]) -> bool:
    """Make this process — its calling thread and every thread and process it starts after —
    unable to write, create, remove or rename any file outside ``writable`` (reading stays
    allowed everywhere), with Linux's Landlock. Threads that already run are not confined: call
    it before DuckDB starts its workers. Returns False where Landlock is not available (not
    Linux, a kernel before 5.13 or without it); it cannot be undone."""
    if sys.platform != "linux":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return False
    handled = (1 << 13) - 1  # ABI 1: execute .. make_sym
    handled |= (1 << 13) if abi >= 2 else 0  # refer (link/rename across folders)
    handled |= (1 << 14) if abi >= 3 else 0  # truncate
    handled |= (1 << 15) if abi >= 5 else 0  # ioctl on devices
    attr = ctypes.create_string_buffer(struct.pack("=Q", handled), 8)
    ruleset = libc.syscall(_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        return False
    try:
        def allow(path: Path, access: int) -> None:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", access & handled & (_FS_FILE if not path.is_dir() else ~0), fd)
                if libc.syscall(_LANDLOCK_ADD_RULE, ruleset, ctypes.c_int(1), ctypes.create_string_buffer(rule, 12),
                                ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock: cannot allow {path}")
            finally:
                os.close(fd)

        allow(Path("/"), _FS_READ)
        allow(Path(os.devnull), _FS_READ | 1 << 1)
        for path in writable:
            allow(path, handled)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which Landlock requires unprivileged
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
        return True
    except OSError as exc:
        log.warning("cannot confine the process with Landlock: %s", exc)
        return False
    finally:
        os.close(ruleset)


def _scratch() -> tuple[Path, Path]:
    """A private scratch folder for this process's query spills, removed at exit, and the folder
    the confined process may write in (its parent: one per user, so the folder can be removed)."""
    import atexit
    import shutil
    import tempfile

    parent = Path(tempfile.gettempdir()) / f"featurehouse-sql-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700)
    st = parent.lstat()
    if not parent.is_dir() or parent.is_symlink() or st.st_uid != os.getuid():
        parent = Path(tempfile.mkdtemp(prefix="featurehouse-sql-"))
    scratch = Path(tempfile.mkdtemp(dir=parent))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch, parent


#: Connections kept open for the life of the process (see ``_hold_catalog``).
_HELD: list[duckdb.DuckDBPyConnection] = []


def _hold_catalog(settings: Settings) -> list[Path]:
    """For an SQLite catalog: the files a reader must still write once the process is confined —
    the shared-memory index of its write-ahead log (``catalog.sqlite-shm``), which every reader
    updates — kept from being deleted and made anew (a file rule holds the file, not its name).

    DuckDB's SQLite opens the catalog for each transaction; SQLite deletes the index when its last
    connection closes, and the next one would have to create it in the warehouse folder. So one
    connection (DuckDB's SQLite, the library DuckLake uses: never Python's, see ``_catalog_state``)
    stays open, in a transaction, until the process ends.
    """
    if settings.catalog_kind != "sqlite":
        return []
    path = _sqlite_file(settings)
    holder = _duckdb(["sqlite_scanner"], {"threads": 1})
    holder.execute(f"ATTACH '{_q(str(path))}' AS held_catalog (TYPE sqlite, READ_ONLY)")
    holder.execute("BEGIN TRANSACTION")
    holder.execute("SELECT count(*) FROM held_catalog.ducklake_metadata").fetchall()
    _HELD.append(holder)
    shm = Path(f"{path}-shm")
    return [shm] if shm.is_file() else []


def sandbox(conn: duckdb.DuckDBPyConnection, *, scratch: Path | None = None) -> None:
    """Lock a read-only connection down for ad-hoc queries: DuckDB's file access limited to the
    warehouse's data files (and ``scratch``, where spills go): no COPY TO elsewhere, no ATTACH,
    no INSTALL/LOAD of new extensions; and the configuration locked so a query cannot undo it.

    Within the data folder DuckDB could still write (it has no read-only directories): the
    process-level confinement of :func:`open_for_queries` is what stops that."""
    dirs = [data_path(conn)] + ([str(scratch).rstrip("/") + "/"] if scratch else [])
    if scratch:
        conn.execute(f"SET temp_directory = '{_q(str(scratch))}'")
    listed = ", ".join(f"'{_q(d)}'" for d in dirs)
    conn.execute(f"SET allowed_directories = [{listed}]")  # no parameter: see _serialized_json
    conn.execute("SET enable_external_access = false")
    conn.execute("SET lock_configuration = true")


def open_for_queries(where: Settings | str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """The warehouse opened read-only for ad-hoc queries (`featurehouse sql`), in a process that
    cannot write the lake any more, whatever statement reaches the connection.

    The catalog is opened first (an SQLite reader writes its shared-memory index beside it),
    with one DuckDB thread; then the process is confined (:func:`confine_process`: it may write
    only in a private scratch folder), then DuckDB's worker threads start — confined too — and
    the connection is sandboxed (:func:`sandbox`). Confinement is for good: use it in a process
    that ends with its queries (a command), not in a long-lived one. Where Landlock is missing it
    logs a warning and the statement check and DuckDB's sandbox are all that stand.
    """
    settings = settings_for(where)
    conn = connect(settings, read_only=True, threads=1)
    try:
        scratch, parent = _scratch()
        if not confine_process([parent, *_hold_catalog(settings)]):
            log.warning("this system cannot confine the process (Linux Landlock is not available): "
                        "only the statement check keeps the query from writing the warehouse's files")
        conn.execute("RESET threads")  # the workers start now, from the confined thread
        sandbox(conn, scratch=scratch)
        return conn
    except BaseException:
        conn.close()
        raise
