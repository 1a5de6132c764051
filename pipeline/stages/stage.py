"""Stage a batch in DuckDB: typed ``stage_<table>`` views that validate and load read from.

Two roads lead into the same staging views:

* **The DuckDB road.** API-JSON pages (one object per file, on one line — what the API and the
  fetcher send) and gzip bulk-export batches of feature, activation or explanation rows are read
  by DuckDB's own ``read_json`` straight from the landing area, typed by column. It never builds
  Python objects for the millions of token values a batch holds, which keeps ingest within a
  small factor of a bare ``read_json`` load (see bench/), and it reads an export batch as a
  stream, so a batch larger than memory still loads.
* **The Python road.** Everything else (flight text, HTML, gzip pages, model and source rows,
  pretty-printed or odd JSON) is parsed in Python (``parse.py``) into records, moved into DuckDB
  through Arrow.

Both roads run one structural check before reading a page (``parse.check_page``: the page
schema, each key once), so a page has one outcome whichever road it takes. An API-JSON page the
DuckDB road cannot read exactly (it fails that check, its number lists hold anything but
numbers, or it is malformed, not one object, or without a valid key) falls back to the Python
road, which either parses it or refuses it with the check's reason. An export file never does (the Python road would hold it whole in memory): a line of it that is not
a JSON object is found by a streaming pass and quarantined, and the rest of the file loads. The
golden tests check that both roads give identical rows for the same data.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import simdjson

from ..lake.landing import open_landed
from .parse import (
    Rejected,
    check_page,
    gunzip_measure,
    json_text,
    json_view,
    open_gzip,
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

log = logging.getLogger("featurehouse")

#: Tables a batch stages, in load order.
STAGED_TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations")

_PY_ROW_BASE = 1 << 40  # _row ids of Python-road records; DuckDB-road ids are page << 20 | position

#: Typed fields of an activation and of an explanation, as pages nest them and as bulk-export
#: rows carry them (a field a source lacks reads as NULL; one we do not know is ignored).
_ACTIVATION_FIELDS: dict[str, str] = {
    "id": "VARCHAR", "modelId": "VARCHAR", "layer": "VARCHAR", "index": "VARCHAR",
    "dataSource": "VARCHAR", "dataIndex": "VARCHAR", "tokens": "VARCHAR[]", "values": "DOUBLE[]",
    "maxValue": "DOUBLE", "maxValueTokenIndex": "INTEGER", "minValue": "DOUBLE",
    "dfaValues": "DOUBLE[]", "dfaTargetIndex": "INTEGER", "dfaMaxValue": "DOUBLE",
    "lossValues": "DOUBLE[]", "logitContributions": "VARCHAR", "binMin": "DOUBLE",
    "binMax": "DOUBLE", "binContains": "DOUBLE", "qualifyingTokenIndex": "INTEGER",
    "creatorId": "VARCHAR", "createdAt": "VARCHAR",
    **{f: "JSON" for f in ACTIVATION_EXTRA_FIELDS},
}
_EXPLANATION_FIELDS: dict[str, str] = {
    "id": "VARCHAR", "modelId": "VARCHAR", "layer": "VARCHAR", "index": "VARCHAR",
    "description": "VARCHAR", "explanationModelName": "VARCHAR", "typeName": "VARCHAR",
    "authorId": "VARCHAR", "scores": "JSON", "createdAt": "VARCHAR", "embedding": "JSON",
    **{f: "JSON" for f in EXPLANATION_EXTRA_FIELDS},
}
assert set(_ACTIVATION_FIELDS) == ACTIVATION_COLUMN_FIELDS | set(ACTIVATION_EXTRA_FIELDS)
assert set(_EXPLANATION_FIELDS) == EXPLANATION_COLUMN_FIELDS | set(EXPLANATION_EXTRA_FIELDS)


def _struct_list(fields: dict[str, str]) -> str:
    return "STRUCT(" + ", ".join(f'"{k}" {v}' for k, v in fields.items()) + ")[]"


_PAGE_COLUMNS: dict[str, str] = {
    "modelId": "VARCHAR", "layer": "VARCHAR", "index": "VARCHAR", "sourceSetName": "VARCHAR",
    "maxActApprox": "DOUBLE", "frac_nonzero": "DOUBLE", "pos_str": "VARCHAR[]",
    "pos_values": "DOUBLE[]", "neg_str": "VARCHAR[]", "neg_values": "DOUBLE[]",
    "hookName": "VARCHAR", "hasVector": "BOOLEAN", "creatorId": "VARCHAR", "createdAt": "VARCHAR",
    **{f: "JSON" for f in FEATURE_EXTRA_FIELDS},
    "model": "JSON", "source": "JSON", "sourceSet": "JSON",
    "activations": _struct_list(_ACTIVATION_FIELDS), "explanations": _struct_list(_EXPLANATION_FIELDS),
    # Present only on bulk-export activation / explanation rows, which are not pages:
    "tokens": "JSON", "values": "JSON", "description": "JSON",
}


assert {k for k in _PAGE_COLUMNS if k not in ("tokens", "values", "description")} == (
    FEATURE_COLUMN_FIELDS | set(FEATURE_EXTRA_FIELDS) | PAGE_RELATIONS)

#: The page's and an activation's fields DuckDB reads as lists of numbers.
_NUMBER_LISTS = [k for k, t in _PAGE_COLUMNS.items() if t == "DOUBLE[]"]


def _numbers_only(v: Any) -> bool:
    """Whether a field read as DOUBLE[] is absent, null or a list of JSON numbers."""
    if v is None:
        return True
    if type(v) is simdjson.Array:
        try:
            v.as_buffer(of_type="d")  # in C, without a Python object per value
        except (TypeError, ValueError):
            return False
        return True
    return type(v) is list and all(type(x) is int or type(x) is float for x in v)


def _typed(fields: dict[str, str]) -> tuple[tuple[str, ...], ...]:
    """A record's fields DuckDB reads as DOUBLE, as INTEGER/BIGINT, as DOUBLE[] and as BOOLEAN."""
    return (tuple(k for k, t in fields.items() if t == "DOUBLE"),
            tuple(k for k, t in fields.items() if t in ("INTEGER", "BIGINT")),
            tuple(k for k, t in fields.items() if t == "DOUBLE[]"),
            tuple(k for k, t in fields.items() if t == "BOOLEAN"))


_ACTIVATION_TYPED = _typed(_ACTIVATION_FIELDS)
_EXPLANATION_TYPED = _typed(_EXPLANATION_FIELDS)
_PAGE_TYPED = _typed({k: t for k, t in _PAGE_COLUMNS.items() if k not in ("activations", "explanations")})
_INDEX_TEXT = re.compile(r"-?[0-9]+")  # parse._DIGITS: an integer written as text


def _exact_fields(obj: Any, typed: tuple[tuple[str, ...], ...], keys: Any = None) -> bool:
    """Whether DuckDB's typed read of an object's fields gives what the Python road makes of
    them. read_json casts where Python does not: ``"2.5"`` and ``true`` to 2.5 and 1.0 in a
    DOUBLE or a DOUBLE[], ``3.7`` to 4 in an INTEGER, and its cast of an ``index`` written as
    text takes ``"2_004"``, ``" 12"`` and ``"1904.0"``; each of these is a value that is not a
    number (``parse._num``, ``parse._int``) to the Python road, which quarantines its record.

    Only the fields the object holds are looked up (``keys``, its keys, if the caller has them):
    a simdjson object's ``get`` of a key it lacks costs ~5 µs (an exception inside), ten times a
    present one's, and an export row lacks several of the typed fields."""
    present = frozenset(obj.keys() if keys is None else keys)
    doubles, integers, lists, booleans = typed
    for k in booleans:  # read_json casts "true" and 1 to true; Python keeps only true/false
        if k in present:
            v = obj[k]
            if v is not None and type(v) is not bool:
                return False
    for k in doubles:
        if k in present:
            v = obj[k]
            if v is not None and type(v) is not float and type(v) is not int:
                return False
    for k in integers:
        if k in present:
            v = obj[k]
            if v is not None and type(v) is not int:
                return False
    if "index" in present:
        index = obj["index"]
        if index is not None and type(index) is not int and not (type(index) is str and _INDEX_TEXT.fullmatch(index)):
            return False
    return all(_numbers_only(obj[k]) for k in lists if k in present)


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


#: A time of day followed by a UTC offset or ``Z`` (``04:30:34.656+02:00``, ``04:30Z``, ``10:00-05``).
_HAS_OFFSET = r"'[0-9]:[0-9]{2}(:[0-9]{2}([.,][0-9]+)?)?\s*([Zz]|[+-][0-9]{2}(:?[0-9]{2})?)$'"


def _ts(expr: str) -> str:
    """SQL reading an ISO timestamp string as a UTC ``TIMESTAMP``, whatever the session's TimeZone.

    With an offset (or ``Z``) the instant is converted to UTC; without one the time is UTC
    already, as the Python road (``parse._ts``) reads it. A cast to TIMESTAMPTZ alone would
    read a zoneless time in the session's (the machine's) zone, and a cast to TIMESTAMP alone
    would drop an offset.
    """
    return (f"(CASE WHEN regexp_matches({expr}, {_HAS_OFFSET}) "
            f"THEN TRY_CAST({expr} AS TIMESTAMPTZ) AT TIME ZONE 'UTC' "
            f"ELSE TRY_CAST({expr} AS TIMESTAMP) END)")


def _drop_keys(expr: str, keys: list[str]) -> str:
    patch = orjson.dumps({k: None for k in keys}).decode()
    return f"CAST(json_merge_patch({expr}, '{patch}') AS VARCHAR)"


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


#: Typed columns of bulk-export rows, by the table they load.
_EXPORT_COLUMNS: dict[str, dict[str, str]] = {
    "activations": _ACTIVATION_FIELDS,
    "explanations": _EXPLANATION_FIELDS,
    "features": {k: v for k, v in _PAGE_COLUMNS.items()
                 if k not in ("model", "source", "sourceSet", "activations", "explanations",
                              "tokens", "values", "description")},
}
_EXPORT_ROW_BASE = 1 << 41  # _row ids of export rows: base + the temp table's rowid


_EXPORT_TYPED = {table: _typed(fields) for table, fields in _EXPORT_COLUMNS.items()}


class LineCheck:
    """Finds, in a stream of an export file's bytes, the lines DuckDB's typed read would take
    otherwise than the Python road: objects that hold a key twice, or hold an object that does
    (read_json keeps the first, or both in a JSON column's text, Python the last; a page with
    one is refused) or whose typed fields do not hold what they say
    (``_exact_fields``). Their positions among the file's non-blank lines (from 1, as DuckDB's
    rows) are in ``inexact``: those lines take the Python road, one line at a time.

    Fed the decompressed bytes in chunks, while the file is measured (``parse.gunzip_measure``),
    so it costs a simdjson parse a line (~1 CPU-s a GB), not a second decompression. A line that
    is not JSON, or not an object, is left to the reading that follows (a bad line), as is one
    longer than ``_MAX_OBJECT``.

    A line holding a field the read has no column for takes the Python road too, which keeps it
    in ``extra``: in an activation file, one its first ``_ACTIVATION_KEY_LINES`` lines lack
    (``_unknown_fields`` reads the columns from them), and any of ``avoid`` (``read_exports``:
    another field's spelling in other case, "foo" beside "Foo").

    ``fields`` then holds the file's fields the typed read does not know (of an activation
    file, those of its first lines), as ``_file_fields`` would read them with DuckDB: handed to
    ``read_exports``, they spare it that second pass over the file.
    """

    def __init__(self, table: str, avoid: frozenset[str] = frozenset()) -> None:
        self.typed = _EXPORT_TYPED[table]
        self._known = {k.lower(): k for k in _EXPORT_COLUMNS[table]}
        self._avoid = avoid
        self._exact_known = frozenset(_EXPORT_COLUMNS[table]) | PAGE_RELATIONS
        self._window = _ACTIVATION_KEY_LINES if table == "activations" else None
        self._parser = simdjson.Parser()
        self._shapes: dict[tuple[str, ...], bool] = {}
        self.reset()

    def reset(self) -> None:
        self.inexact: list[int] = []
        self.page_line: int | None = None  # the first line holding a page's own key (model, activations...)
        self._pos = 0
        self._pending = b""
        self._too_long = False  # inside a line past _MAX_OBJECT: counted once, not parsed
        self._columns = set(self._known.values())  # and the fields of the window's lines (of every line)

    def feed(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n") if self._pending else chunk.split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if self._too_long:
                self._too_long = False  # its end: it was counted when it began
                continue
            self._line(line)
        if len(self._pending) >= _MAX_OBJECT:
            if not self._too_long:
                self._pos += 1
                self._too_long = True
            self._pending = b""

    def finish(self) -> list[int]:
        if self._pending and not self._too_long:
            self._line(self._pending)
        self._pending = b""
        return self.inexact

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return  # read_json skips blank lines: they have no position
        self._pos += 1
        try:
            doc = self._parser.parse(line)
        except (ValueError, RuntimeError):
            # Not JSON to simdjson (NaN, a trailing comma, a number past 64 bits, nesting past
            # its depth, bytes that are not UTF-8): DuckDB's reader may take what orjson does
            # not, so the Python road judges it, as it judges the line in a plain .jsonl file
            # (a line DuckDB cannot read either is set aside as a bad line first).
            self.inexact.append(self._pos)
            return
        try:
            if type(doc) is simdjson.Object:
                keys = list(doc.keys())
                if self.page_line is None and not PAGE_RELATIONS.isdisjoint(keys):
                    self.page_line = self._pos  # a whole page among export rows: the file is refused
                if (not self._read_as_columns(keys) or not self._plain_keys(keys)
                        or not _exact_fields(doc, self.typed, keys)
                        # an object in it (a memchr finds none in most lines) holding a key twice
                        or (line.find(b"{", line.find(b"{") + 1) >= 0 and repeated_key(doc, line) is not None)):
                    self.inexact.append(self._pos)
        finally:
            del doc  # the parser is reused only once nothing refers to its last document

    def _read_as_columns(self, keys: list[str]) -> bool:
        """Whether DuckDB's read has a column for each of a line's fields (the class's doc)."""
        if self._avoid and not self._avoid.isdisjoint(keys):
            return False
        if self._window is None or self._pos <= self._window:
            self._columns.update(keys)
            return True
        return self._columns.issuperset(keys)

    @property
    def fields(self) -> frozenset[str]:
        """The fields seen that the typed read does not know, as written (the class's doc)."""
        return frozenset(self._columns - self._exact_known)

    def _plain_keys(self, keys: list[str]) -> bool:
        """No key twice, and every key spelled as known (``_spelled_as_known``); judged once
        for each list of keys (the lines of a file mostly share one)."""
        shape = tuple(keys)
        plain = self._shapes.get(shape)
        if plain is None:
            plain = len(keys) == len(set(keys)) and self._spelled_as_known(keys)
            if len(self._shapes) < 1024:
                self._shapes[shape] = plain
        return plain

    def _spelled_as_known(self, keys: list[str]) -> bool:
        """No key is a known field spelled in other case ("MaxValue"), nor two keys one name in
        two cases: DuckDB's columns are one name in any case (the read cannot hold both)."""
        lowered = {k.lower() for k in keys}
        if len(lowered) != len(keys):
            return False
        known = self._known
        return all(known.get(k.lower(), k) == k for k in keys)


def export_table(first: bytes) -> str | None:
    """Which table a bulk-export JSON-lines file loads, judged by its first line, or None when
    it is not one of the three row kinds (model / source rows take the Python road)."""
    try:
        row = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(row, dict):
        return None
    keys = row.keys()
    if keys & {"activations", "explanations", "model", "source", "sourceSet"}:
        return None  # a whole feature page (gzip API JSON), not an export row
    if "tokens" in keys or "values" in keys:
        return "activations"
    if "description" in keys and "layer" in keys:
        return "explanations"
    if "layer" in keys and "index" in keys:
        return "features"
    return None


@dataclass(frozen=True)
class BadLine:
    """A line of an export file that is not a JSON object: quarantined, the rest of the file loads."""

    line_no: int
    """Its line number in the decompressed file, counting from 1."""
    text: str
    """The line as received, without its newline (at most ``_KEPT_BYTES``; bytes that are not
    UTF-8 shown as U+FFFD)."""
    problem: str
    """What is wrong with it, to follow "line N of FILE": ``is not valid JSON (byte 38: ...)``."""


@dataclass
class ExportRead:
    """What ``read_exports`` made of a batch's export files."""

    read: set[str] = field(default_factory=set)
    """Digests of the files read (their good rows are in ``fast_export_<table>``)."""
    bad_lines: dict[str, list[BadLine]] = field(default_factory=dict)
    """Digest → the file's lines that are not JSON objects, to quarantine."""
    refused: dict[str, str] = field(default_factory=dict)
    """Digest → why the file is refused whole (nothing of it is staged)."""
    python_lines: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    """Digest → ``(line number, line)`` of the file's lines DuckDB would read otherwise than
    the Python road (``LineCheck``): not in ``fast_export_<table>``, for the Python road."""


#: A file with more bad lines than this is refused whole: it is not an export batch with a few
#: damaged lines but something else (binary after a good first line, another format).
MAX_BAD_LINES = 1000
_MAX_OBJECT = 1 << 25  # read_json's maximum_object_size, and the longest line the scan holds
KEPT_BYTES = _KEPT_BYTES = 1 << 16  # of a bad line, kept in quarantine
_PENDING_LINES = 256  # doubtful lines judged by DuckDB at a time ...
_PENDING_BYTES = 1 << 24  # ... or once they hold this much


def read_exports(conn: duckdb.DuckDBPyConnection, files: dict[str, list[tuple[str, Path, int]]],
                 inexact: dict[str, list[int]] | None = None,
                 fields: dict[str, frozenset[str]] | None = None) -> ExportRead:
    """Read gzip bulk-export files with DuckDB, streaming, into ``fast_export_<table>``.

    ``files`` maps a data table to ``(sha256, landed path, number of newlines)`` triples. Every
    file stays on this road, however large. ``read_json(ignore_errors = true)`` gives a line
    that is not a JSON object (cut short, not JSON, an array) a row of NULLs, in the line's
    place; a line cut short can take the good line after it down with it the same way. Only a
    file with such rows (or fewer rows than lines) is looked at again, as a stream: the bad
    lines are returned in ``bad_lines`` for quarantine, and the good lines DuckDB lost are read
    again. ``inexact`` maps a file to the positions of lines DuckDB would read otherwise than the
    Python road (``LineCheck``): their rows are removed and the lines returned in
    ``python_lines``. A file DuckDB cannot read at all for a line in it (an object written over
    several lines stops read_json, ignore_errors or not) is streamed the same way, its lines
    that are JSON objects read again. A file with more than ``MAX_BAD_LINES`` bad lines, or one
    DuckDB cannot read even so, is refused whole.
    """
    inexact = dict(inexact or {})
    out = ExportRead()
    for table, known in _EXPORT_COLUMNS.items():
        group = files.get(table) or []
        # Fields the typed read does not know are read as JSON, for `extra`.
        unknown, others = _unknown_fields(conn, group, known, fields)
        columns = {**known, **{k: "JSON" for k in unknown}}
        for sha, path, _ in group:
            if sha in others:  # a field with no column of its own: its lines take the Python road
                try:
                    inexact[sha] = sorted({*inexact.get(sha, ()), *_lines_holding(table, path, others[sha])})
                except Rejected as exc:  # never seen: the file was measured whole just before
                    out.refused[sha] = str(exc)
        group = [g for g in group if g[0] not in out.refused]
        parsed = _EXPORT_EMBEDDING if table == "explanations" else {}
        cols = ", ".join(f'"{k.replace(chr(34), chr(34) * 2)}" {v}' for k, v in {**columns, **parsed}.items())
        conn.execute(
            f"CREATE OR REPLACE TEMP TABLE fast_export_{table} (input_sha256 VARCHAR, {cols})"
        )
        if not group:
            continue
        unread = _insert_exports(conn, table, [(sha, path) for sha, path, _ in group], columns)
        # A row without any scalar is the cheap sign (no list is read) of a bad line.
        no_scalar = " AND ".join(f'"{k}" IS NULL' for k, v in columns.items() if not v.endswith("[]"))
        for sha, path, _ in group:
            if sha in unread and _GZIP_HINT in unread[sha]:
                out.refused[sha] = unread[sha]  # not its lines: its gzip stream
            elif sha in unread:
                refused = _read_line_by_line(conn, table, sha, path, set(inexact.get(sha, ())), out)
                if refused:  # DuckDB's own reason for the whole file says more than ours
                    out.refused[sha] = unread[sha] if refused is _UNREADABLE else refused
        counts = {sha: (n, n_empty) for sha, n, n_empty in conn.execute(
            f"""SELECT input_sha256, count(*), count(*) FILTER (WHERE {no_scalar})
                FROM fast_export_{table} GROUP BY 1"""
        ).fetchall()}
        for sha, path, n_newlines in group:
            if sha in out.refused:
                continue
            if sha in unread:
                out.read.add(sha)  # read line by line
                continue
            n_rows, n_empty = counts.get(sha, (0, 0))
            if n_empty or n_rows < n_newlines or inexact.get(sha):
                refused = _set_bad_lines_aside(conn, table, no_scalar, sha, path, out, set(inexact.get(sha, ())))
                if refused:
                    conn.execute(f"DELETE FROM fast_export_{table} WHERE input_sha256 = ?", [sha])
                    out.refused[sha] = refused
                    continue
            out.read.add(sha)
    return out


_ACTIVATION_KEY_LINES = 10_000


def _unknown_fields(conn: duckdb.DuckDBPyConnection, group: list[tuple[str, Path, int]], known: dict[str, str],
                    given: dict[str, frozenset[str]] | None = None) -> tuple[list[str], dict[str, frozenset[str]]]:
    """The fields of the files' lines that ``known`` does not type, by name (read as columns),
    and, by file, those of its fields that are spelled otherwise than their column.

    DuckDB's column names are one name in any case: of the spellings of a field in several
    cases ("Foo", "foo"; JSON keys are case-sensitive, and a page keeps both in ``extra``) the
    first in sort order is the column, and a file's lines holding another take the Python road.
    A field spelled as a known one in other case ("MaxValue") is no column: its lines take the
    Python road already (``LineCheck``).

    One pass of DuckDB's JSON reader over the lines' keys (no value is typed), so that a field
    only some lines carry is kept too; of an activation file (they are the big ones), over its
    first ``_ACTIVATION_KEY_LINES`` lines, and a later line holding a field they lack takes
    the Python road (``LineCheck``). ``given``: each file's fields as its ``LineCheck`` found
    them while it was measured; then DuckDB reads no file for them (~9 % of a whole source's
    CPU went to that pass).
    """
    if not group:
        return [], {}
    if given is not None and all(sha in given for sha, _, _ in group):
        found = {sha: sorted(given[sha]) for sha, _, _ in group}
    else:
        found = _file_fields(conn, group, known)
    taken = {k.lower() for k in set(known) | PAGE_RELATIONS}
    columns: dict[str, str] = {}
    for k in sorted({k for keys in found.values() for k in keys}):
        if k.lower() not in taken:
            columns.setdefault(k.lower(), k)
    chosen = set(columns.values())
    others = {sha: frozenset(k for k in keys if k.lower() in columns and k not in chosen) for sha, keys in found.items()}
    return list(columns.values()), {sha: keys for sha, keys in others.items() if keys}


def _file_fields(conn: duckdb.DuckDBPyConnection, group: list[tuple[str, Path, int]],
                 known: dict[str, str]) -> dict[str, list[str]]:
    """Each file's fields that ``known`` does not type (``_unknown_fields``); a file DuckDB
    cannot read has none here (the read that follows says what is wrong with it)."""
    params: dict[str, Any] = {"known": sorted(set(known) | PAGE_RELATIONS), "max": _MAX_OBJECT}
    options = "format = 'newline_delimited', compression = 'gzip', ignore_errors = true, maximum_object_size = $max"
    if "tokens" in known:  # an activation file: its first lines, each file's own
        lines = " UNION ALL ".join(
            f"(SELECT {i} AS f, json FROM read_json_objects($file{i}, {options}) WHERE json IS NOT NULL "
            f"LIMIT {_ACTIVATION_KEY_LINES})" for i in range(len(group)))
        params |= {f"file{i}": str(path) for i, (_, path, _) in enumerate(group)}
    else:
        lines = f"SELECT list_position($files, filename) - 1 AS f, json FROM read_json_objects($files, {options}, filename = true)"
        params["files"] = [str(path) for _, path, _ in group]
    try:
        rows = conn.execute(
            f"""SELECT f, list(DISTINCT k ORDER BY k) FROM (SELECT f, unnest(json_keys(json)) AS k FROM ({lines}))
                WHERE k NOT IN (SELECT unnest($known::VARCHAR[])) GROUP BY f""", params).fetchall()
    except (duckdb.InvalidInputException, duckdb.IOException):
        if len(group) == 1:
            return {}
        return {sha: keys for one in group for sha, keys in _file_fields(conn, [one], known).items()}
    return {group[f][0]: keys for f, keys in rows}


def _lines_holding(table: str, path: Path, fields: frozenset[str]) -> list[int]:
    """The positions of the lines of export file ``path`` that DuckDB's read would take
    otherwise than the Python road, when ``fields`` have no column (``LineCheck``): one more
    stream of the file, paid only by a file holding one."""
    check = LineCheck(table, avoid=fields)
    with open_landed(path) as stream:
        gunzip_measure(stream, 1 << 62, lines=check)
    return check.finish()


_GZIP_HINT = ("; DuckDB refuses bytes after the last gzip member, such as zero padding: "
              "re-download or re-export the file")


def _insert_exports(conn: duckdb.DuckDBPyConnection, table: str, group: list[tuple[str, Path]],
                    columns: dict[str, str] | None = None) -> dict[str, str]:
    """Append the rows of ``group``'s files to ``fast_export_<table>``, each file's in the order
    of its lines; returns the files that could not be read at all (with DuckDB's reason)."""
    paths = [str(p) for _, p in group]
    try:
        # Streams: no window, sort or join over the rows (a row's id is the temp table's rowid),
        # so a batch larger than DuckDB's memory cap spills instead of failing, and the rows
        # keep the order of the lines (read_json and INSERT preserve insertion order).
        select = f"""SELECT $shas[list_position($files, j.filename)] AS input_sha256, j.* EXCLUDE (filename)
                FROM read_json($files, columns = $columns, format = 'newline_delimited',
                               compression = 'gzip', filename = true, ignore_errors = true,
                               maximum_object_size = {_MAX_OBJECT}) AS j"""
        if table == "explanations":
            select = _with_embedding(select, "embedding", name="embedding_values", keep_raw=True)
        conn.execute(
            f"""INSERT INTO fast_export_{table} BY NAME {select}""",
            {"files": paths, "shas": [sha for sha, _ in group], "columns": columns or _EXPORT_COLUMNS[table]},
        )
    except (duckdb.InvalidInputException, duckdb.IOException) as exc:
        # Something in a file (not memory or the disk, which fail the run to be tried again):
        # the statement left nothing behind, so find the file(s) it was about. DuckDB's gzip
        # reader refuses bytes after the last member (zero padding) that gzip itself accepts.
        if isinstance(exc, duckdb.IOException) and "gzip" not in str(exc).lower():
            raise
        if len(group) == 1:
            log.info("DuckDB could not read export file %s: %s", paths[0], exc)
            hint = _GZIP_HINT if isinstance(exc, duckdb.IOException) else ""
            return {group[0][0]: f"DuckDB could not read it as gzip JSON lines: {_first_line(exc)}{hint}"}
        refused: dict[str, str] = {}
        for one in group:
            refused.update(_insert_exports(conn, table, [one], columns))
        return refused
    return {}


_UNREADABLE = "DuckDB cannot read its lines that are objects either"


def _read_line_by_line(conn: duckdb.DuckDBPyConnection, table: str, sha: str, path: Path, inexact: set[int],
                       out: ExportRead) -> str | None:
    """Read a file that DuckDB's read_json refused whole: stream it once, set its bad lines
    aside, copy its lines that are JSON objects to a file DuckDB then reads (the inexact ones
    to the Python road). Returns why it is refused whole instead, or None."""
    fd, name = tempfile.mkstemp(prefix="export-lines-", suffix=".jsonl.gz", dir=_temp_dir(conn))
    os.close(fd)
    again = Path(name)
    try:
        n_lines, bad, n_again, _, python = _scan_lines(conn, path, _EVERY_LINE, again, inexact)
        if len(bad) > MAX_BAD_LINES or not n_again + len(python):
            return _too_many(bad) if bad else _UNREADABLE
        bad = merge_objects(bad)
        if n_again and _insert_exports(conn, table, [(sha, again)], {
                c: t for c, t in _table_columns(conn, f"fast_export_{table}").items() if c not in _EXPORT_EMBEDDING}):
            return _UNREADABLE
        (n_now,) = conn.execute(f"SELECT count(*) FROM fast_export_{table} WHERE input_sha256 = ?", [sha]).fetchone()
        if n_now != n_again:
            conn.execute(f"DELETE FROM fast_export_{table} WHERE input_sha256 = ?", [sha])
            return (f"DuckDB read {n_now:,} rows from its {n_again:,} good lines: refused whole "
                    "rather than loaded in part")
        if bad:
            out.bad_lines[sha] = bad
        if python:
            out.python_lines[sha] = [(n, line) for _, n, line in python]
        return None
    finally:
        again.unlink(missing_ok=True)


class _Every:
    """Every position: a file whose every line is looked at."""

    def __contains__(self, _: object) -> bool:
        return True


_EVERY_LINE: Any = _Every()


def _temp_dir(conn: duckdb.DuckDBPyConnection) -> str | None:
    (tmp_dir,) = conn.execute("SELECT current_setting('temp_directory')").fetchone()
    if tmp_dir:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    return tmp_dir or None


def _too_many(bad: list[BadLine]) -> str:
    first = bad[0]
    return (f"more than {MAX_BAD_LINES:,} of its lines are not JSON objects (the first: line "
            f"{first.line_no} {first.problem}); refused whole: it is not a readable export batch")


def _set_bad_lines_aside(conn: duckdb.DuckDBPyConnection, table: str, no_scalar: str, sha: str, path: Path,
                         out: ExportRead, inexact: set[int] = frozenset()) -> str | None:
    """Put one file's lines that are not JSON objects in ``out.bad_lines`` and replace the rows
    DuckDB made of the lines around them. Returns why the file is refused whole instead, or None.

    The rows without a scalar are where the trouble is: their positions among the file's rows
    are those of the lines DuckDB could not read (the rows keep the lines' order). The file is
    streamed once: the lines at those positions that are objects are copied, to be read again,
    and every line is checked, so that a bad line elsewhere (the positions did not line up)
    refuses the file rather than losing a row.
    """
    n_rows, empty = conn.execute(
        f"""SELECT count(*), list(pos ORDER BY pos) FILTER (WHERE empty) FROM (
                SELECT row_number() OVER (ORDER BY rowid) AS pos, ({no_scalar}) AS empty
                FROM fast_export_{table} WHERE input_sha256 = ?)""",
        [sha],
    ).fetchone()
    fd, name = tempfile.mkstemp(prefix="export-lines-", suffix=".jsonl.gz", dir=_temp_dir(conn))
    os.close(fd)
    again = Path(name)
    try:
        n_lines, bad, n_again, stray, python = _scan_lines(conn, path, set(empty or ()) | inexact, again, inexact)
        if len(bad) > MAX_BAD_LINES:
            return _too_many(bad)
        if n_rows != n_lines or stray:  # never seen; refuse rather than load a part blindly
            return (f"DuckDB's reading of it does not line up with its lines ({n_rows:,} rows from "
                    f"{n_lines:,} non-blank lines, {len(bad):,} of them not JSON objects): refused whole "
                    "rather than loaded in part")
        if python:  # by position, before any row is removed: the rows are in the order of the lines
            conn.execute(
                f"""DELETE FROM fast_export_{table} WHERE rowid IN (
                        SELECT rowid FROM (SELECT rowid, row_number() OVER (ORDER BY rowid) AS pos
                                           FROM fast_export_{table} WHERE input_sha256 = $sha)
                        WHERE pos IN (SELECT unnest($pos::BIGINT[])))""",
                {"sha": sha, "pos": [p for p, _, _ in python]})
            out.python_lines[sha] = [(n, line) for _, n, line in python]
        if not bad:
            return None  # its rows without a scalar are objects without one: they are validated
        conn.execute(f"DELETE FROM fast_export_{table} WHERE input_sha256 = ? AND {no_scalar}", [sha])
        n_bad_lines = len(bad)
        bad = merge_objects(bad)
        if n_again:
            refused = _insert_exports(conn, table, [(sha, again)], {
                c: t for c, t in _table_columns(conn, f"fast_export_{table}").items() if c not in _EXPORT_EMBEDDING})
            if refused:
                return refused[sha]
        (n_now,) = conn.execute(f"SELECT count(*) FROM fast_export_{table} WHERE input_sha256 = ?", [sha]).fetchone()
        n_good = n_lines - n_bad_lines - len(python)
        if n_now != n_good:
            out.python_lines.pop(sha, None)
            return (f"DuckDB read {n_now:,} rows from its {n_good:,} good lines: refused whole "
                    "rather than loaded in part")
        out.bad_lines[sha] = bad
        return None
    finally:
        again.unlink(missing_ok=True)


def _scan_lines(conn: duckdb.DuckDBPyConnection, src: Path, trouble: set[int], again: Path,
                inexact: set[int] = frozenset()) -> tuple[int, list[BadLine], int, bool, list[tuple[int, int, bytes]]]:
    """Stream gzip JSON-lines ``src`` once, one line in memory at a time.

    ``trouble`` holds positions among the non-blank lines (from 1). Returns the number of
    non-blank lines; those that are not JSON objects (up to ``MAX_BAD_LINES + 1``); how many
    lines at a ``trouble`` position are objects, copied to gzip ``again``; whether a bad line
    was found at another position; and the ``(position, line number, line)`` of the objects at
    an ``inexact`` position (part of ``trouble``), which are not copied. simdjson passes the lines that are plainly objects; the
    others are judged by DuckDB's own JSON parser, the one read_json uses (it also takes NaN,
    Infinity and trailing commas).
    """
    parser = simdjson.Parser()
    bad: list[BadLine] = []
    python: list[tuple[int, int, bytes]] = []
    doubtful: list[tuple[int, int, bytes]] = []  # position, line number, line
    n_again = pos = line_no = held = 0
    stray = False
    with gzip.open(src, "rb") as f, gzip.open(again, "wb", compresslevel=1) as copy:

        def settle() -> None:
            nonlocal n_again, stray, held
            judged = {b.line_no: b for b in _judge(conn, [(n, line) for _, n, line in doubtful])}
            for p, n, line in doubtful:
                if n in judged:
                    bad.append(judged[n])
                    stray = stray or p not in trouble
                elif p in inexact:
                    python.append((p, n, line.rstrip(b"\r\n")))
                elif p in trouble:
                    copy.write(line if line.endswith(b"\n") else line + b"\n")
                    n_again += 1
            doubtful.clear()
            held = 0

        while line := f.readline(_MAX_OBJECT):
            line_no += 1
            if len(line) == _MAX_OBJECT and not line.endswith(b"\n"):
                # Too long to hold: DuckDB's reading of it stands (it is bad where DuckDB failed).
                n = len(line)
                while (rest := f.readline(_MAX_OBJECT)) and not rest.endswith(b"\n"):
                    n += len(rest)
                pos += 1
                if pos in trouble:
                    text = line[:_KEPT_BYTES].decode("utf-8", "replace") + f"… ({n + len(rest):,} bytes in all)"
                    bad.append(BadLine(line_no, text, f"is longer than {_MAX_OBJECT >> 20} MiB and DuckDB could not read it"))
                continue
            if not line.strip():
                continue  # read_json skips blank lines: they have no position
            pos += 1
            if pos not in trouble:
                try:
                    doc = parser.parse(line)
                    is_object = isinstance(doc, simdjson.Object)
                    del doc  # the parser is reused only once nothing refers to its last document
                except ValueError:
                    is_object = False
                if is_object:
                    continue
            doubtful.append((pos, line_no, line))
            held += len(line)
            if len(doubtful) >= _PENDING_LINES or held >= _PENDING_BYTES:
                settle()
                if len(bad) > MAX_BAD_LINES:
                    break
        settle()
    bad.sort(key=lambda b: b.line_no)
    return pos, bad[: MAX_BAD_LINES + 1], n_again, stray, python


_JSON_TYPES = {"ARRAY": "an array", "VARCHAR": "a string", "BIGINT": "a number", "UBIGINT": "a number",
               "DOUBLE": "a number", "BOOLEAN": "a boolean", "NULL": "null"}


def _judge(conn: duckdb.DuckDBPyConnection, lines: list[tuple[int, bytes]]) -> list[BadLine]:
    """Of ``(line number, line)`` pairs, those DuckDB's JSON reader does not take as an object."""
    bad: list[BadLine] = []
    texts: list[tuple[int, str, str]] = []  # line number, text, text as kept
    for line_no, line in lines:
        raw = line.removesuffix(b"\n")
        kept = raw[:_KEPT_BYTES].decode("utf-8", "replace")
        if len(raw) > _KEPT_BYTES:
            kept += f"… ({len(raw):,} bytes in all)"
        try:
            texts.append((line_no, raw.decode("utf-8"), kept))
        except UnicodeDecodeError as exc:
            bad.append(BadLine(line_no, kept, f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"))
    if texts:
        conn.register("_lines", pa.table({"i": pa.array(range(len(texts)), pa.int64()),
                                          "line": pa.array([t for _, t, _ in texts], pa.string())}))
        try:
            kinds = conn.execute("SELECT json_type(TRY_CAST(line AS JSON)) FROM _lines ORDER BY i").fetchall()
        finally:
            conn.unregister("_lines")
        for (line_no, text, kept), (kind,) in zip(texts, kinds, strict=True):
            if kind == "OBJECT":
                continue
            if kind is None:
                try:
                    conn.execute("SELECT CAST($line AS JSON)", {"line": text})
                    problem = "is not valid JSON"
                except duckdb.Error as exc:
                    problem = f"is not valid JSON ({_json_message(exc)})"
            else:
                problem = f"is {_JSON_TYPES.get(kind, kind.lower())}, not a JSON object"
            bad.append(BadLine(line_no, kept, problem))
    return sorted(bad, key=lambda b: b.line_no)


def merge_objects(bad: list[BadLine]) -> list[BadLine]:
    """Bad lines (sorted) with each run of consecutive lines that together hold one JSON object
    (one written over several lines, as ``json.dumps(indent=2)`` writes it) made one bad line:
    one record lost, quarantined once, not one entry a line of it."""
    out: list[BadLine] = []
    i = 0
    while i < len(bad):
        j = i
        if bad[i].text.lstrip().startswith("{"):
            while j + 1 < len(bad) and bad[j + 1].line_no == bad[j].line_no + 1 and not bad[j].text.rstrip().endswith("}"):
                j += 1
            if j > i:
                text = "\n".join(b.text for b in bad[i:j + 1])
                try:
                    whole = type(orjson.loads(text)) is dict
                except orjson.JSONDecodeError:
                    whole = False
                if whole:
                    out.append(BadLine(bad[i].line_no, text[:_KEPT_BYTES], f"is the first of lines {bad[i].line_no}–"
                                       f"{bad[j].line_no}, one JSON object written over {j - i + 1} lines, not one "
                                       "line (JSON lines hold an object a line)"))
                    i = j + 1
                    continue
                j = i
        out.append(bad[i])
        i += 1
    return out


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _json_message(exc: BaseException) -> str:
    """DuckDB's words for a JSON syntax error, without the echo of the input:
    ``Malformed JSON at byte 38 of input: unexpected end of data`` → ``byte 38: unexpected end of data``."""
    msg = _first_line(exc)
    found = re.search(r"at byte (\d+) of input: (.*?)\.?\s*(Input:|$)", msg)
    return f"byte {found[1]}: {found[2]}" if found else msg


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


def _extra_sql(a: str, listed: tuple[str, ...], unlisted: list[str] = ()) -> str:
    """SQL for ``a``'s ``extra``: its ``listed`` fields (null when absent), then the ``unlisted``
    ones (fields of an export file the typed read does not know, read as JSON) that are not
    null, by name: as ``parse._extra`` builds it on the Python road."""
    listed_sql = "json_object(" + ", ".join(f"'{f}', {a}.\"{f}\"" for f in listed) + ")"
    lit, ident = (lambda f: f.replace("'", "''")), (lambda f: f.replace('"', '""'))
    if not unlisted:
        return f"CAST({listed_sql} AS VARCHAR)"
    entries = ", ".join(f"{{'k': '{lit(f)}', 'v': {a}.\"{ident(f)}\"}}" for f in sorted(unlisted))
    rest = f"CAST(to_json(map_from_entries(list_filter([{entries}], e -> e.v IS NOT NULL))) AS VARCHAR)"
    # two JSON objects' members joined: '{"a":1}' and '{"b":2}' → '{"a":1,"b":2}'
    return (f"(CASE WHEN {rest} = '{{}}' THEN CAST({listed_sql} AS VARCHAR) "
            f"ELSE rtrim(CAST({listed_sql} AS VARCHAR), '}}') || ',' || {rest}[2:] END)")


#: An explanation embedding's JSON text holds only a list of JSON numbers (the grammar's).
_NUMBER_LIST = r"\s*\[\s*(NUM(\s*,\s*NUM)*)?\s*\]\s*".replace(
    "NUM", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _embedding_text(e: str) -> str:
    """SQL for the JSON text of an explanation's ``embedding`` (JSON: a list, or a string
    holding one), NULL when it is absent or null; computed once per row, in a subquery."""
    raw = f"(CASE WHEN json_type({e}) = 'NULL' THEN NULL ELSE {e} END)"
    return f"(CASE WHEN json_type({raw}) = 'VARCHAR' THEN {raw}->>'$' ELSE CAST({raw} AS VARCHAR) END)"


#: Over a row with ``_emb_text`` (``_embedding_text``) and ``_emb_nums`` (that text cast to
#: DOUBLE[]): whether the embedding is all finite numbers (the JSON grammar of a list of
#: numbers, no value lost in the cast). The text is cast to DOUBLE[] through JSON: DuckDB's
#: JSON reader parses a 256-value list ~6x faster than its VARCHAR-to-list cast (0.9 against
#: 5.9 CPU-s for 65,536 embeddings, 2026-12-06), to the same doubles on every text this
#: grammar takes (``-0`` aside, which the JSON road reads as 0, as orjson does on the Python road).
_EMBEDDING_NUMERIC = f"""
    CASE WHEN _emb_text IS NULL THEN NULL
         ELSE coalesce(regexp_full_match(_emb_text, '{_NUMBER_LIST}') AND list_count(_emb_nums) = len(_emb_nums)
                       AND len(list_filter(_emb_nums, x -> NOT isfinite(x))) = 0, false) END"""
#: ... then ``embedding`` and ``embedding_dim`` (how many values it holds), as
#: ``parse._embedding`` gives them on the Python road; the suite quarantines a bad one.
_EMBEDDING_COLUMNS = """
    CASE WHEN embedding_numeric THEN _emb_nums END AS embedding,
    CAST(CASE WHEN embedding_numeric THEN len(_emb_nums)
              WHEN json_type(TRY_CAST(_emb_text AS JSON)) = 'ARRAY' THEN json_array_length(TRY_CAST(_emb_text AS JSON))
         END AS INTEGER) AS embedding_dim"""


def _with_embedding(select: str, e: str, *, name: str = "embedding", keep_raw: bool = False) -> str:
    """``select`` (whose rows have the JSON ``e``) with the embedding's columns (the numbers as
    ``name``), each computed once (a subquery a step: DuckDB expands a reference to a column
    alias of the same SELECT). ``keep_raw`` keeps ``e`` where it is not a list of numbers (what
    a quarantined record shows), and drops it where the numbers say all."""
    raw = f"CASE WHEN embedding_numeric THEN NULL ELSE {e} END AS {e}, " if keep_raw else ""
    columns = _EMBEDDING_COLUMNS.replace("END AS embedding,", f"END AS {name},")
    return (f"SELECT * EXCLUDE (_emb_text, _emb_nums, {e}), {raw}{columns} FROM ("
            f"SELECT *, {_EMBEDDING_NUMERIC} AS embedding_numeric FROM ("
            f"SELECT *, TRY_CAST(TRY_CAST(_emb_text AS JSON) AS DOUBLE[]) AS _emb_nums FROM ("
            f"SELECT *, {_embedding_text(e)} AS _emb_text FROM ({select}))))")


#: What the export road keeps of an embedding, parsed as it is read (``_insert_exports``): the
#: numbers, not the text (a 256-value list is ~3.4 KB of JSON), so a batch holds it once.
_EXPORT_EMBEDDING = {"embedding_values": "DOUBLE[]", "embedding_dim": "INTEGER", "embedding_numeric": "BOOLEAN"}


def _feature_columns(p: str, unlisted: list[str] = ()) -> str:
    """Select list mapping a feature object ``p`` (page or export row) to ``features`` columns."""
    return f"""{p}.modelId AS model_id, {p}.layer AS source_id, TRY_CAST({p}."index" AS BIGINT) AS feature_index,
               {p}.sourceSetName AS source_set_name, {p}.maxActApprox AS max_act_approx,
               {p}.frac_nonzero, {p}.pos_str, {p}.pos_values, {p}.neg_str, {p}.neg_values,
               {p}.hookName AS hook_name, {p}.hasVector AS has_vector, {p}.creatorId AS creator_id,
               {_ts(f"{p}.createdAt")} AS created_at,
               {_extra_sql(p, FEATURE_EXTRA_FIELDS, unlisted)} AS extra"""


def _activation_columns(a: str, unlisted: list[str] = ()) -> str:
    """Select list mapping an activation object ``a`` (page element or export row)."""
    return f"""{a}.id AS activation_id, {a}.modelId AS model_id, {a}.layer AS source_id,
               TRY_CAST({a}."index" AS BIGINT) AS feature_index, {a}.dataSource AS data_source,
               {a}.dataIndex AS data_index, {a}.tokens, {a}."values", {a}.maxValue AS max_value,
               {a}.maxValueTokenIndex AS max_value_token_index, {a}.minValue AS min_value,
               {a}.dfaValues AS dfa_values, {a}.dfaTargetIndex AS dfa_target_index,
               {a}.dfaMaxValue AS dfa_max_value, {a}.lossValues AS loss_values,
               {a}.logitContributions AS logit_contributions, {a}.binMin AS bin_min,
               {a}.binMax AS bin_max, {a}.binContains AS bin_contains,
               {a}.qualifyingTokenIndex AS qualifying_token_index, {a}.creatorId AS creator_id,
               {_ts(f"{a}.createdAt")} AS created_at,
               {_extra_sql(a, ACTIVATION_EXTRA_FIELDS, unlisted)} AS extra"""


def _explanation_columns(e: str, model: str, layer: str, index: str, unlisted: list[str] = (),
                         embedding: str | None = None) -> str:
    """Select list mapping an explanation object ``e``; its key falls back to its page's."""
    return f"""{e}.id AS explanation_id, coalesce({e}.modelId, {model}) AS model_id,
               coalesce({e}.layer, {layer}) AS source_id,
               coalesce(TRY_CAST({e}."index" AS BIGINT), {index}) AS feature_index,
               {e}.description, {e}.explanationModelName AS explanation_model,
               {e}.typeName AS type_name, {e}.authorId AS author_id,
               CAST({e}.scores AS VARCHAR) AS scores, {_ts(f"{e}.createdAt")} AS created_at,
               {embedding or f"{e}.embedding AS embedding_json"},
               {_extra_sql(e, EXPLANATION_EXTRA_FIELDS, unlisted)} AS extra"""


def _own_key(a: str) -> str:
    """``model/source/index`` of an object; an index that is not a number is kept as written."""
    return (f"""{a}.modelId || '/' || {a}.layer || '/' || """
            f"""coalesce(CAST(TRY_CAST({a}."index" AS BIGINT) AS VARCHAR), {a}."index", '?')""")


def _table_columns(conn: duckdb.DuckDBPyConnection, name: str) -> dict[str, str]:
    """A temp table's columns and their types, but ``input_sha256``. (``DESCRIBE`` of the one
    table: ``duckdb_columns()`` would list the lake's tables too, a catalog read.)"""
    return {c: t for c, t, *_ in conn.execute(f'DESCRIBE temp.main."{name}"').fetchall() if c != "input_sha256"}


def _export_select(table: str, unlisted: list[str] = ()) -> str:
    """SQL giving the export road's rows for a data table (bulk-export rows carry their own key);
    ``unlisted``: the fields read for ``extra`` only (``_first_line_fields``)."""
    row = f"input_sha256, {_EXPORT_ROW_BASE} + rowid AS _row"
    if table == "features":
        return f"SELECT {_feature_columns('r', unlisted)}, {row} FROM fast_export_features AS r"
    if table == "activations":
        return (f"SELECT {_activation_columns('r', unlisted)}, {row}, {_own_key('r')} AS page_key "
                "FROM fast_export_activations AS r")
    parsed = "r.embedding_values AS embedding, r.embedding_dim, r.embedding_numeric"
    return (f"SELECT {_explanation_columns('r', 'NULL', 'NULL', 'NULL', unlisted, parsed)}, {row} "
            "FROM fast_export_explanations AS r")


def _fast_select(table: str) -> str:
    """SQL giving the DuckDB road's rows for ``table``, with the same columns as the Python road."""
    if table == "features":
        return f"SELECT {_feature_columns('p')}, p.input_sha256, p._page << 20 AS _row FROM fast_pages AS p"
    if table == "activations":
        return f"""
            SELECT {_activation_columns('a')}, input_sha256, (_page << 20) + pos AS _row, page_key
            FROM (
                SELECT p.input_sha256, p._page, {_own_key('p')} AS page_key,
                       unnest(p.activations) AS a, generate_subscripts(p.activations, 1) AS pos
                FROM fast_pages AS p
            )"""
    if table == "explanations":
        return _with_embedding(f"""
            SELECT {_explanation_columns('e', 'page_model', 'page_layer', 'page_index')},
                   input_sha256, (_page << 20) + pos AS _row
            FROM (
                -- an explanation takes its page's key only when that is a feature's, as
                -- parse._add_page: under a page with index -5 it is quarantined too
                SELECT p.input_sha256, p._page, p.modelId AS page_model, p.layer AS page_layer,
                       CASE WHEN CAST(p."index" AS BIGINT) >= 0 THEN CAST(p."index" AS BIGINT) END AS page_index,
                       unnest(p.explanations) AS e, generate_subscripts(p.explanations, 1) AS pos
                FROM fast_pages AS p
            )""", "embedding_json")
    if table == "models":
        core = ["id", "displayName", "owner", "tlensId", "layers", "dimension", "createdAt", "updatedAt"]
        return f"""
            SELECT model->>'id' AS model_id, model->>'displayName' AS display_name,
                   model->>'owner' AS owner, model->>'tlensId' AS tlens_id,
                   TRY_CAST(model->>'layers' AS INTEGER) AS n_layers,
                   TRY_CAST(model->>'dimension' AS INTEGER) AS dimension,
                   {_ts("model->>'createdAt'")} AS created_at, {_ts("model->>'updatedAt'")} AS updated_at,
                   {_drop_keys("model", core)} AS extra, input_sha256, _page << 20 AS _row
            FROM fast_pages WHERE json_type(model) = 'OBJECT'"""
    if table == "sources":
        core = ["id", "modelId", "setName", "hfRepoId", "hfFolderId", "dataset", "num_tokens_in_prompt", "createdAt"]
        return f"""
            SELECT coalesce(source->>'modelId', modelId) AS model_id, coalesce(source->>'id', '') AS source_id,
                   source->>'setName' AS source_set_name, source->>'hfRepoId' AS hf_repo_id,
                   source->>'hfFolderId' AS hf_folder_id, source->>'dataset' AS dataset,
                   TRY_CAST(source->>'num_tokens_in_prompt' AS INTEGER) AS num_tokens_in_prompt,
                   {_ts("source->>'createdAt'")} AS created_at,
                   {_drop_keys("source", core)} AS extra, input_sha256, _page << 20 AS _row
            FROM fast_pages WHERE json_type(source) = 'OBJECT'"""
    if table == "source_sets":
        core = ["modelId", "name", "description", "type", "creatorName", "releaseName", "urls", "createdAt"]
        return f"""
            SELECT coalesce(sourceSet->>'modelId', modelId) AS model_id,
                   coalesce(sourceSet->>'name', '') AS source_set_name,
                   sourceSet->>'description' AS description, sourceSet->>'type' AS type_name,
                   sourceSet->>'creatorName' AS creator_name, sourceSet->>'releaseName' AS release_name,
                   CAST(sourceSet->'urls' AS VARCHAR[]) AS urls,
                   {_ts("sourceSet->>'createdAt'")} AS created_at,
                   {_drop_keys("sourceSet", core)} AS extra, input_sha256, _page << 20 AS _row
            FROM fast_pages WHERE json_type(sourceSet) = 'OBJECT'"""
    raise ValueError(table)


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


def _export_lines(conn: duckdb.DuckDBPyConnection, table: str, rows: list[int],
                  files: dict[str, Path]) -> dict[int, tuple[str, str]]:
    """The lines behind export ``rows`` of ``table``, cut out of their files (see
    ``plan_export_lines``)."""
    return cut_export_lines(plan_export_lines(conn, table, rows, files))


@dataclass
class ExportLines:
    """Which lines of which local export files hold a batch's refused export rows (made by
    ``plan_export_lines``, cut by ``cut_export_lines``, which needs no DuckDB connection)."""

    wanted: dict[str, dict[int, int]]  # digest → position among its non-blank lines → _row
    files: dict[str, Path]
    n_rows: dict[str, int]  # digest → the file's rows in the staged table


def plan_export_lines(conn: duckdb.DuckDBPyConnection, table: str, rows: list[int],
                      files: dict[str, Path]) -> ExportLines:
    """Where the export ``rows`` of ``table`` are in their files. A file's rows are its
    non-blank lines in order (``_insert_exports``) unless some of its lines were set aside, so
    such files are not in ``files``; a file whose rows are not contiguous in the staged table
    (one deleted or added since it was read) is left out, and its records fetched as typed."""
    rows = [r for r in rows if r >= _EXPORT_ROW_BASE]
    if not files or not rows:
        return ExportLines({}, {}, {})
    spans = {sha: (first, n) for sha, first, last, n in conn.execute(
        f"""SELECT input_sha256, min(rowid), max(rowid), count(*) FROM fast_export_{table}
            WHERE list_contains($shas, input_sha256) GROUP BY 1""", {"shas": list(files)}).fetchall()
        if last - first + 1 == n}  # contiguous: no row of it deleted or added since it was read
    wanted: dict[str, dict[int, int]] = {}
    for r in rows:
        rowid = r - _EXPORT_ROW_BASE
        for sha, (first, n) in spans.items():
            if first <= rowid < first + n:
                wanted.setdefault(sha, {})[rowid - first] = r
                break
    return ExportLines(wanted, {sha: files[sha] for sha in wanted}, {sha: spans[sha][1] for sha in wanted})


def cut_export_lines(plan: ExportLines) -> dict[int, tuple[str, str]]:
    """The planned lines, ``_row → (sha256, line)``: one stream of each file (ISA-L's gzip:
    1.7 s for a 1 GiB batch on one core, where fetching 3,942 of its 157,680 rows from the
    staged table as JSON took 4.8 s on two: DuckDB reads every vector of their token and value
    lists again). Touches no DuckDB connection: ``ingest`` runs it in a thread beside the
    batch's Parquet write. A file whose lines turn out not to be its rows (count, order) gives
    none here, and its records are fetched as typed instead."""
    out: dict[int, tuple[str, str]] = {}
    for sha, positions in plan.wanted.items():
        found: dict[int, tuple[str, str]] = {}
        pos = 0
        with open_gzip(plan.files[sha]) as f:
            while line := f.readline(_MAX_OBJECT):
                if len(line) == _MAX_OBJECT and not line.endswith(b"\n"):
                    pos = -1  # a line too long to hold: DuckDB did not read it as a row either
                    break
                if not line.strip():
                    continue  # read_json skips blank lines: they have no row
                r = positions.get(pos)
                if r is not None:
                    found[r] = (sha, line.strip().decode("utf-8", "replace"))
                pos += 1
        if pos == plan.n_rows[sha] and len(found) == len(positions):
            out.update(found)
        else:  # never seen: the rows are not the file's lines; its records are fetched as typed
            log.warning("export file %s: %s rows, %s lines; its quarantined records are kept as typed",
                        plan.files[sha], plan.n_rows[sha], pos)
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
