"""The export road: DuckDB's streaming read of gzip bulk-export batches of feature, activation
or explanation rows into ``fast_export_<table>`` (``read_exports``), with the fields the typed
read does not know kept for ``extra``, and the lines that are not JSON objects found by a
streaming pass and quarantined (``BadLine``, ``merge_objects``) while the rest of the file loads.

The check of each line as the file is measured is ``line_check.py``; the lines behind refused
rows, read back as received, are ``export_lines.py``; the columns, ``columns.py``.
"""

from __future__ import annotations

import gzip
import logging
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
from .columns import _EXPORT_COLUMNS, _EXPORT_EMBEDDING, _table_columns, _with_embedding
from .line_check import _ACTIVATION_KEY_LINES, _MAX_OBJECT, LineCheck
from .parse import Rejected, gunzip_measure
from .records import PAGE_RELATIONS
from .spool import expanded_copy, scratch_path

log = logging.getLogger("featurehouse")


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
KEPT_BYTES = _KEPT_BYTES = 1 << 16  # of a bad line, kept in quarantine
_PENDING_LINES = 256  # doubtful lines judged by DuckDB at a time ...
_PENDING_BYTES = 1 << 24  # ... or once they hold this much


def read_exports(conn: duckdb.DuckDBPyConnection, files: dict[str, list[tuple[str, Path, int]]],
                 inexact: dict[str, list[int]] | None = None,
                 fields: dict[str, frozenset[str]] | None = None,
                 spools: dict[str, str] | None = None) -> ExportRead:
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
    DuckDB cannot read even so, is refused whole. ``spools`` maps a file to a copy of its
    expanded bytes (``spool.Spool``): DuckDB's typed read takes that instead of the gzip (every
    other look at the file reads the gzip).
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
        spooled = [(sha, Path(spools[sha])) for sha, _, _ in group if spools and sha in spools]
        unread = {**_insert_exports(conn, table, spooled, columns, compression="uncompressed"),
                  **_insert_exports(conn, table, [(sha, path) for sha, path, _ in group if not spools or sha not in spools],
                                    columns)}
        for sha, path, _ in group:
            if sha in unread and _GZIP_HINT in unread[sha]:
                # DuckDB's gzip reader refuses bytes gzip reads (zero padding after the last
                # member); the landing pass read it whole: its expanded bytes are read instead,
                # as they are for a file copied aside while landing (spool.py), so it loads
                # whichever road it took. Refused as before where no copy can be made.
                with open_landed(path) as raw:
                    copy = expanded_copy(raw, Path(_temp_dir(conn) or tempfile.gettempdir()))
                if copy is not None:
                    try:
                        if not _insert_exports(conn, table, [(sha, Path(copy.path))], columns, "uncompressed"):
                            del unread[sha]
                    finally:
                        copy.close()
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
                    columns: dict[str, str] | None = None, compression: str = "gzip") -> dict[str, str]:
    """Append the rows of ``group``'s files to ``fast_export_<table>``, each file's in the order
    of its lines; returns the files that could not be read at all (with DuckDB's reason)."""
    if not group:
        return {}
    paths = [str(p) for _, p in group]
    try:
        # Streams: no window, sort or join over the rows (a row's id is the temp table's rowid),
        # so a batch larger than DuckDB's memory cap spills instead of failing, and the rows
        # keep the order of the lines (read_json and INSERT preserve insertion order).
        select = f"""SELECT $shas[list_position($files, j.filename)] AS input_sha256, j.* EXCLUDE (filename)
                FROM read_json($files, columns = $columns, format = 'newline_delimited',
                               compression = '{compression}', filename = true, ignore_errors = true,
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
            refused.update(_insert_exports(conn, table, [one], columns, compression))
        return refused
    return {}


_UNREADABLE = "DuckDB cannot read its lines that are objects either"


def _read_line_by_line(conn: duckdb.DuckDBPyConnection, table: str, sha: str, path: Path, inexact: set[int],
                       out: ExportRead) -> str | None:
    """Read a file that DuckDB's read_json refused whole: stream it once, set its bad lines
    aside, copy its lines that are JSON objects to a file DuckDB then reads (the inexact ones
    to the Python road). Returns why it is refused whole instead, or None."""
    with scratch_path(_temp_dir(conn), "export-lines-", ".jsonl.gz") as again:
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
    with scratch_path(_temp_dir(conn), "export-lines-", ".jsonl.gz") as again:
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
