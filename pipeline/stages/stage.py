"""Stage a batch in DuckDB: typed ``stage_<table>`` views that validate and load read from.

Two roads lead into the same staging views:

* **The DuckDB road.** API-JSON pages (one object per file, on one line — what the API and the
  fetcher send; ``read_api_json`` here) and gzip bulk-export batches of feature, activation or
  explanation rows (``export_road.py``, its lines checked as they stream by ``line_check.py``)
  are read by DuckDB's own ``read_json`` straight from the landing area, typed by column
  (``columns.py``). It never builds Python objects for the millions of token values a batch
  holds, which keeps ingest within a small factor of a bare ``read_json`` load (see bench/),
  and it reads an export batch as a stream, so a batch larger than memory still loads.
* **The Python road.** Everything else (flight text, HTML, gzip pages, model and source rows,
  pretty-printed or odd JSON) is parsed in Python (``parse.py``) into records, moved into DuckDB
  through Arrow (``stage_parsed`` here).

Both roads run one structural check before reading a page (``parse.check_page``: the page
schema, each key once), so a page has one outcome whichever road it takes. An API-JSON page the
DuckDB road cannot read exactly (it fails that check, its number lists hold anything but
numbers, or it is malformed, not one object, or without a valid key) falls back to the Python
road, which either parses it or refuses it with the check's reason. An export file never does (the Python road would hold it whole in memory): a line of it that is not
a JSON object is found by a streaming pass and quarantined, and the rest of the file loads. The
golden tests check that both roads give identical rows for the same data.

This module holds the page road, the views both roads fill (``create_views``), and the records
behind staged rows as received (``raw_records``; an export file's lines: ``export_lines.py``).
The export road's names are imported here too, as ``stage.<name>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import simdjson

from .columns import (
    _ACTIVATION_TYPED,
    _EXPLANATION_TYPED,
    _EXPORT_COLUMNS,
    _EXPORT_EMBEDDING,
    _EXPORT_ROW_BASE,
    _NUMBER_LISTS,
    _PAGE_COLUMNS,
    _PAGE_TYPED,
    _PY_ROW_BASE,
    _exact_fields,
    _export_select,
    _fast_select,
    _numbers_only,
    _table_columns,
)
from .export_lines import ExportLines, _export_lines, cut_export_lines, plan_export_lines
from .export_road import (
    KEPT_BYTES,
    MAX_BAD_LINES,
    BadLine,
    ExportRead,
    export_table,
    merge_objects,
    read_exports,
)
from .line_check import LineCheck
from .parse import (
    Rejected,
    check_page,
    json_text,
    json_view,
    repeated_key,
)
from .records import (
    ACTIVATION_COLUMN_FIELDS,
    ACTIVATION_EXTRA_FIELDS,
    ARROW_SCHEMAS,
    EXPLANATION_COLUMN_FIELDS,
    EXPLANATION_EXTRA_FIELDS,
    FEATURE_COLUMN_FIELDS,
    FEATURE_EXTRA_FIELDS,
    PAGE_RELATIONS,
    to_arrow,
    unlisted_fields,
)

__all__ = [
    "STAGED_TABLES", "read_api_json", "exact_activations", "LineCheck", "KEPT_BYTES", "export_table", "read_exports", "ExportRead", "BadLine", "MAX_BAD_LINES", "merge_objects", "stage_parsed", "create_views",
    "keep_staged", "raw_records", "ExportLines", "plan_export_lines", "cut_export_lines", "drop",
]

#: Tables a batch stages, in load order.
STAGED_TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations")


def exact_activations(data: bytes) -> int | None:
    """The number of activations of a one-line page whose typed read by DuckDB gives what the
    Python road makes of it; None for a page it would not (the Python road reads it).

    The page must pass the structural check both roads run (``parse.check_page``, and no object
    in it, at any depth, holding a key twice: ``parse.repeated_key``; else the Python road
    refuses it, with the reason), and its typed fields hold what they say
    (``_exact_fields``): read_json turns ``"1.5"`` and ``true`` into numbers and ``"x"`` into
    null, where the Python road finds values that are not numbers. Costs a simdjson parse (~0.25 ms for a 280 KB page) and the
    checks (~0.4 ms, and ~0.3 ms for the keys), not a Python object per token or value.
    """
    try:
        page = json_view(data)
        check_page(page, "JSON input")
    except Rejected:
        return None
    if repeated_key(page, data) is not None:  # deeper than the schema looks: the Python road refuses it
        return None
    if type(page) is not simdjson.Object:
        # simdjson refused a number (an integer past 64 bits, 1e400, NaN): DuckDB would keep its
        # digits as text where Python reads a float, or refuses it; the Python road decides
        return None
    # a field the typed read does not know would be lost: the Python road keeps it in `extra`
    if unlisted_fields(page.keys(), FEATURE_COLUMN_FIELDS | PAGE_RELATIONS, FEATURE_EXTRA_FIELDS):
        return None
    for kind, columns, listed in (("activations", ACTIVATION_COLUMN_FIELDS, ACTIVATION_EXTRA_FIELDS),
                                  ("explanations", EXPLANATION_COLUMN_FIELDS, EXPLANATION_EXTRA_FIELDS)):
        if any(unlisted_fields(x.keys(), columns, listed) for x in (page.get(kind) or ())):
            return None
    activations = page.get("activations") or ()
    if (all(_numbers_only(page.get(k)) for k in _NUMBER_LISTS)
            and all(_exact_fields(a, _ACTIVATION_TYPED) for a in activations)
            and all(_exact_fields(e, _EXPLANATION_TYPED) for e in (page.get("explanations") or ()))
            and all(page.get(k) is None or type(page.get(k)) in (int, float) for k in _PAGE_TYPED[0])):
        return len(activations)
    return None


def _read_exactly(data: bytes) -> bool:
    """Whether DuckDB's typed read of a one-line page gives what the Python road makes of it
    (:func:`exact_activations`)."""
    return exact_activations(data) is not None


def read_api_json(conn: duckdb.DuckDBPyConnection, files: list[tuple[str, Path]], *, checked: bool = False) -> set[str]:
    """Read single-line API-JSON pages with DuckDB into the temp table ``fast_pages``.

    ``files`` pairs each input's sha256 with its landed path. Returns the digests read cleanly
    (exactly one object with a model, a source and a numeric index, read exactly as the Python
    road would: ``_read_exactly``); the others are not read, or removed from ``fast_pages``, and
    must take the Python road. ``checked``: the caller found each file's bytes read exactly
    (``exact_activations``, on the bytes it held), so the files are not read and checked again.
    """
    conn.execute("CREATE OR REPLACE TEMP TABLE fast_files (path VARCHAR, input_sha256 VARCHAR, _page BIGINT)")
    columns = ", ".join(f'"{name}" {sql_type}' for name, sql_type in _PAGE_COLUMNS.items())
    conn.execute(f"CREATE OR REPLACE TEMP TABLE fast_pages (input_sha256 VARCHAR, _page BIGINT, {columns})")
    if not checked:
        files = [(sha, path) for sha, path in files if _read_exactly(Path(path).read_bytes())]
    if not files:
        return set()
    conn.register("_fast_files", pa.table({
        "path": [str(p) for _, p in files],
        "input_sha256": [sha for sha, _ in files],
        "_page": list(range(len(files))),
    }))
    conn.execute("INSERT INTO fast_files SELECT * FROM _fast_files")
    conn.unregister("_fast_files")
    conn.execute(
        """INSERT INTO fast_pages BY NAME
           SELECT f.input_sha256, f._page, j.* EXCLUDE (filename)
           FROM read_json($files, columns = $columns, format = 'newline_delimited',
                          filename = true, ignore_errors = true,
                          maximum_object_size = $max_object) AS j
           JOIN fast_files AS f ON f.path = j.filename""",
        # read_json allocates a buffer of maximum_object_size: size it to this batch's largest file
        {"files": [str(p) for _, p in files], "columns": _PAGE_COLUMNS,
         "max_object": max(p.stat().st_size for _, p in files) + (1 << 16)},
    )
    good = {
        sha for (sha,) in conn.execute(
            """SELECT input_sha256 FROM fast_pages GROUP BY input_sha256
               HAVING count(*) = 1
                  AND bool_and(coalesce(modelId <> '' AND layer <> ''
                               AND regexp_full_match("index", '-?[0-9]{1,18}'), false))
                  AND bool_and(tokens IS NULL AND "values" IS NULL AND description IS NULL)"""
        ).fetchall()
    }
    conn.execute(
        "DELETE FROM fast_pages WHERE input_sha256 NOT IN (SELECT unnest($good::VARCHAR[]))",
        {"good": sorted(good)},
    )
    return good


def _arrow_with_meta(table: str, items: list[tuple[str, Any]], start: int) -> pa.Table:
    arrow = to_arrow(table, [r for _, r in items])
    n = arrow.num_rows
    arrow = arrow.append_column("input_sha256", pa.array([sha for sha, _ in items], pa.string()))
    arrow = arrow.append_column("_row", pa.array(range(start, start + n), pa.int64()))
    if table in ("features", "activations", "explanations"):
        raw = [json_text(r.raw) for _, r in items]  # a flight date as the API writes it
        arrow = arrow.append_column("_raw", pa.array(raw, pa.string()))
    if table == "activations":
        arrow = arrow.append_column("page_key", pa.array([r.page_key for _, r in items], pa.string()))
    if table == "explanations":  # what the suite checks of an embedding (not loaded)
        arrow = arrow.append_column("embedding_dim", pa.array([r.embedding_dim for _, r in items], pa.int32()))
        arrow = arrow.append_column("embedding_numeric", pa.array([r.embedding_numeric for _, r in items], pa.bool_()))
    return arrow


def stage_parsed(conn: duckdb.DuckDBPyConnection, records: dict[str, list[tuple[str, Any]]]) -> None:
    """Move Python-road records (``table → [(sha256, record)]``) into temp tables ``py_<table>``."""
    for table in STAGED_TABLES:
        arrow = _arrow_with_meta(table, records.get(table, []), _PY_ROW_BASE)
        conn.register("_py_rows", arrow)
        conn.execute(f"CREATE OR REPLACE TEMP TABLE py_{table} AS SELECT * FROM _py_rows")
        conn.unregister("_py_rows")


#: Columns whose equality makes two staged records "the same record".
def _content_columns(table: str) -> list[str]:
    return [f.name for f in ARROW_SCHEMAS[table]]


def create_views(conn: duckdb.DuckDBPyConnection) -> None:
    """Create the ``stage_<table>`` tables: both roads united, exact duplicates collapsed.

    A record that one input carries more than once with identical contents is kept once.
    Copies of one key with different contents in one input are all kept, so that the suite's
    uniqueness expectation refuses them rather than one silently winning; copies from different
    inputs are captures competing in the load (``captures.claim_captures`` for a feature, the
    newest capture for an activation or explanation id). Bookkeeping tables
    (models, sources, source sets) keep the last copy per key. The (costly) content hash is
    only computed when a key repeats at all.
    """
    for table in STAGED_TABLES:
        keys = _KEYS[table]
        if table in _RAW_TABLES:
            unlisted = [c for c in _table_columns(conn, f"fast_export_{table}")
                        if c not in _EXPORT_COLUMNS[table] and c not in _EXPORT_EMBEDDING]
            union = f"""SELECT * FROM ({_fast_select(table)})
                        UNION ALL BY NAME SELECT * FROM ({_export_select(table, unlisted)})
                        UNION ALL BY NAME SELECT * EXCLUDE (_raw) FROM py_{table}"""
        else:
            union = f"SELECT * FROM ({_fast_select(table)}) UNION ALL BY NAME SELECT * FROM py_{table}"
        conn.execute(f"CREATE OR REPLACE TEMP VIEW stage_{table}_all AS {union}")
        # row(): a record without a key (validation refuses it) is not a repeat; counted bare,
        # its NULL would be skipped and a many-GB export batch sent through the window below.
        (repeats,) = conn.execute(
            f"SELECT count(*) > count(DISTINCT row({keys})) FROM stage_{table}_all"
        ).fetchone()
        if not repeats:  # the usual case: a view, so the batch is not copied once more
            conn.execute(f"CREATE OR REPLACE TEMP VIEW stage_{table} AS {union}")
        else:
            if table in _RAW_TABLES:
                content = ", ".join(f'"{c}"' for c in _content_columns(table))
                partition = f"{keys}, input_sha256, hash({content})"
            else:
                partition = keys
            conn.execute(
                f"""CREATE OR REPLACE TEMP TABLE stage_{table} AS SELECT * FROM stage_{table}_all
                    QUALIFY row_number() OVER (PARTITION BY {partition} ORDER BY _row DESC) = 1"""
            )
        conn.execute(f"DROP VIEW stage_{table}_all")


def keep_staged(conn: duckdb.DuckDBPyConnection, table: str, predicate: str) -> None:
    """Keep only the staged ``table`` records for which ``predicate`` (over alias ``s``) holds."""
    conn.execute(f"CREATE OR REPLACE TEMP TABLE stage_{table}_kept AS SELECT * FROM stage_{table} AS s WHERE {predicate}")
    _drop_stage(conn, table)
    conn.execute(f"ALTER TABLE stage_{table}_kept RENAME TO stage_{table}")


def _path_sha(pair: Any) -> tuple[str, str]:
    return (pair["path"], pair["input_sha256"]) if isinstance(pair, dict) else (pair[0], pair[1])


def _drop_stage(conn: duckdb.DuckDBPyConnection, table: str) -> None:
    # qualified: an unqualified lookup would also ask the lakehouse's catalog
    try:
        conn.execute(f"DROP VIEW IF EXISTS temp.main.stage_{table}")
    except duckdb.CatalogException:  # it is a table (deduplicated, or kept by keep_staged)
        conn.execute(f"DROP TABLE temp.main.stage_{table}")


def raw_records(conn: duckdb.DuckDBPyConnection, table: str, rows: list[int],
                export_files: dict[str, Path] | None = None,
                lines: dict[int, tuple[str, str]] | None = None) -> dict[int, tuple[str, str]]:
    """The records behind staged ``rows`` of ``table``, as received: ``_row → (sha256, JSON)``.
    ``export_files``: the batch's local export files (digest → path) whose rows are their lines
    in order (no line of them was set aside): their records are their lines, as received.
    ``lines``: those lines cut out already (``cut_export_lines`` of ``plan_export_lines``, in
    another thread); the export rows it lacks are fetched as typed."""
    if not rows:
        return {}
    export = [r for r in rows if r >= _EXPORT_ROW_BASE]
    if lines is None:
        lines = _export_lines(conn, table, export, export_files or {}) if export else {}
    export = [r for r in export if r not in lines]
    if export:  # the other export rows as typed (a file on S3 is not fetched again for a few records)
        record = ("json_merge_patch(to_json(r), json_object('embedding_values', NULL, 'embedding_dim', NULL, "
                  "'embedding_numeric', NULL, 'embedding', coalesce(r.embedding, to_json(r.embedding_values))))"
                  if table == "explanations" else "to_json(r)")  # the embedding as received, or its numbers
        q = f"""SELECT {_EXPORT_ROW_BASE} + rowid AS _row, input_sha256, CAST({record} AS VARCHAR)
                FROM fast_export_{table} AS r
                WHERE rowid IN (SELECT unnest($rows::BIGINT[]) - {_EXPORT_ROW_BASE})"""
        found = {r: (sha, j) for r, sha, j in conn.execute(q, {"rows": export}).fetchall()}
    rows = [r for r in rows if r < _EXPORT_ROW_BASE]
    fast = [r for r in rows if r < _PY_ROW_BASE]
    out: dict[int, tuple[str, str]] = {}
    if fast:
        # The refused records as received (a value that was not a number shows as it was sent),
        # cut out of their landed pages. simdjson finds an element without building Python
        # objects for the rest of the page (a batch may refuse one record in each of a thousand
        # pages: 4 ms a page with orjson, under 1 ms with simdjson).
        by_page: dict[int, list[int]] = {}
        for r in fast:
            by_page.setdefault(r >> 20, []).append(r)
        files = dict(conn.execute(
            "SELECT _page, (path, input_sha256) FROM fast_files WHERE _page IN (SELECT unnest($pages::BIGINT[]))",
            {"pages": sorted(by_page)},
        ).fetchall())
        parser = simdjson.Parser()
        for page_no, page_rows in by_page.items():
            path, sha = _path_sha(files[page_no])
            data = Path(path).read_bytes()
            try:
                if table == "features":
                    page = orjson.loads(data)
                    record = orjson.dumps({k: v for k, v in page.items() if k not in _RELATIONS}).decode()
                    out.update({r: (sha, record) for r in page_rows})
                    continue
                doc = parser.parse(data)
                try:
                    for r in page_rows:  # generate_subscripts counts from 1
                        record = doc.at_pointer(f"/{table}/{(r & 0xFFFFF) - 1}")
                        # an object, as the page check requires; a scalar is kept as it is, never a crash
                        text = record.mini if hasattr(record, "mini") else orjson.dumps(record)
                        out[r] = (sha, text.decode())
                        del record
                finally:
                    del doc  # the parser is reused only once no element of the last page is alive
            except (ValueError, RuntimeError):
                # JSON that DuckDB reads but strict parsers refuse (NaN, Infinity, 1e400): the
                # standard library's parser takes it, slowly, for this page only.
                page = json.loads(data)
                for r in page_rows:
                    record = ({k: v for k, v in page.items() if k not in _RELATIONS} if table == "features"
                              else page[table][(r & 0xFFFFF) - 1])
                    out[r] = (sha, json.dumps(record, ensure_ascii=False, separators=(",", ":")))
    slow = [r for r in rows if r >= _PY_ROW_BASE]
    if slow:
        q = f"SELECT _row, input_sha256, _raw FROM py_{table} WHERE _row IN (SELECT unnest($rows::BIGINT[]))"
        out.update({r: (sha, j) for r, sha, j in conn.execute(q, {"rows": slow}).fetchall()})
    if export:
        out.update(found)
    out.update(lines)
    return out


_KEYS = {
    "features": "model_id, source_id, feature_index", "activations": "activation_id",
    "explanations": "explanation_id", "models": "model_id",
    "sources": "model_id, source_id", "source_sets": "model_id, source_set_name",
}
_RAW_TABLES = ("features", "activations", "explanations")
_RELATIONS = ("activations", "explanations", "model", "source", "sourceSet", "lists", "creator", "comments")


def drop(conn: duckdb.DuckDBPyConnection) -> None:
    """Remove the batch's staging objects."""
    for table in STAGED_TABLES:
        _drop_stage(conn, table)
        conn.execute(f"DROP TABLE IF EXISTS temp.main.py_{table}")
    conn.execute("DROP TABLE IF EXISTS temp.main.fast_pages")
    for table in _EXPORT_COLUMNS:
        conn.execute(f"DROP TABLE IF EXISTS temp.main.fast_export_{table}")
    conn.execute("DROP TABLE IF EXISTS temp.main.fast_files")
    conn.execute("DROP TABLE IF EXISTS temp.main.stage_activation_checks")  # made by validate
