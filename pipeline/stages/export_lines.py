"""The lines behind an export batch's refused rows, read back as received: where they are in
their local files (``plan_export_lines``, with DuckDB) and cut out of them (``cut_export_lines``,
without it), so a quarantined record shows what was sent rather than its typed read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import duckdb

from .columns import _EXPORT_ROW_BASE
from .line_check import _MAX_OBJECT
from .parse import open_gzip

log = logging.getLogger("featurehouse")


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
