"""The ``hf`` layout's files of one table: how a table is cut (a file per source and 1,024
features, ``HF_CHUNK``; ``features`` and the small tables one file), and writing them sorted from
one read of the warehouse, streamed to pyarrow's ``ParquetWriter`` on a thread of its own in whole
row groups of ``ROW_GROUP_ROWS``; with the files before, only the files the changes touch are
written and the others are linked.
"""

from __future__ import annotations

import collections
import concurrent.futures
from pathlib import Path

import duckdb

from ..lake.warehouse import CATALOG, _q
from .publish_folder import _link_or_copy_file
from .publish_names import _KEY, ROW_GROUP_ROWS
from .publish_snapshot import _ident, _order

#: Features per file of a table in the ``hf`` layout: a table keyed by feature is written as one
#: file per source and run of 1,024 feature indices (Neuronpedia's own export batches: a source's
#: features in files of 1,024), so a publication after a load rewrites only the files of the
#: features it changed; the others are hard links to the files before (kept, not sent again).
HF_CHUNK = 1024
#: What ``hf/.published.json`` says of how the files are cut (a folder cut otherwise is written whole).
HF_LAYOUT = f"chunks-{HF_CHUNK}"


def _chunked(table: str, names: list[str]) -> bool:
    """Whether a table is cut into files by source and feature: one keyed by feature (the three
    key columns), but ``features``, which stays one file (``data_0.parquet``): the table a reader
    opens first (pandas reads one file over HTTP, where it cannot list a folder), one small row
    a feature (~0.2 % of a publication's bytes)."""
    return table != "features" and all(k in names for k in _KEY)


def _chunk_sql(a: str = "") -> str:
    """SQL for the file a row goes to (``_chunked``): its source's digest and its run of indices,
    as the file's name without ``.parquet``. ``a``: the rows' alias and a dot."""
    return (f"left(md5(coalesce({a}model_id, '') || chr(0) || coalesce({a}source_id, '')), 12) || '-' || "
            f"lpad(CAST(coalesce({a}feature_index // {HF_CHUNK}, -1) AS VARCHAR), 7, '0')")


def _write_hf_table(conn: duckdb.DuckDBPyConnection, table: str, names: list[str], snap: int, target: Path,
                    old: Path | None, changed: set[str] | None) -> None:
    """Write ``table``'s files into ``target``: cut by source and feature (``_chunked``), each file
    sorted; with ``old`` (the files before) and ``changed`` (the files the changes touch), the
    others are linked from ``old`` and only those are written (an emptied one is left out)."""
    sel = ", ".join(_ident(c) for c in names)
    src = f"{CATALOG}.main.{table} AT (VERSION => {snap})"
    opts = f"FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {ROW_GROUP_ROWS}"
    target.mkdir(parents=True, exist_ok=True)
    if not _chunked(table, names):  # features, and the small tables (models, sources, ...): one file
        conn.execute(f"COPY (SELECT {sel} FROM {src} ORDER BY {_order(names)}) TO '{_q(str(target / 'data_0.parquet'))}' ({opts})")
        return
    where = ""
    if old is not None and changed is not None:
        for f in sorted(old.glob("*.parquet")):
            if f.stem not in changed and f.name != "data_0.parquet":  # (that: an empty table's columns)
                _link_or_copy_file(f, target / f.name)
        if not changed:
            return
        conn.execute("CREATE OR REPLACE TEMP TABLE _hf_changed (chunk VARCHAR)")
        conn.executemany("INSERT INTO _hf_changed VALUES (?)", [[c] for c in sorted(changed)])
        where = "WHERE _chunk IN (SELECT chunk FROM _hf_changed)"
    _stream_chunks(conn, sel, src, names, target, where)


def _stream_chunks(conn: duckdb.DuckDBPyConnection, sel: str, src: str, names: list[str], target: Path,
                   where: str = "") -> list[Path]:
    """``src``'s rows (those ``where`` keeps) sorted by file (``_chunk``) and key, one Parquet file
    a chunk into ``target``, each in that order (a lookup by feature reads one row group, not
    all); the files written, in order. One sorted read, streamed to pyarrow's Parquet writer a
    batch at a time: a temp table of the sorted rows, then a COPY a file, each scanning it for its
    rows, cost twice the CPU (activations of 65,536 features: 6.4 against 3.2 CPU-s, 2026-12-07);
    DuckDB's PARTITION_BY does not keep the rows' order inside a file."""
    import pyarrow as pa
    import pyarrow.compute as pc

    target.mkdir(parents=True, exist_ok=True)
    sql = (f"SELECT * FROM (SELECT {sel}, {_chunk_sql()} AS _chunk FROM {src}) {where} "
           f"ORDER BY _chunk, {_order(names)}")
    # a JSON column as DuckDB's own writer keeps it (Parquet's JSON type): DuckDB hands it over as text
    json_cols = {n for n, t in zip(names, conn.sql(f"SELECT {sel} FROM {src} LIMIT 0").types) if str(t) == "JSON"}
    schema: pa.Schema | None = None
    out = _ChunkFiles(target)
    # the files written on a thread of their own (pyarrow lets the GIL go as it encodes), while
    # DuckDB hands over the next batches: a few batches ahead at most
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-write") as pool:
        try:
            for batch in conn.execute(sql).to_arrow_reader(ROW_GROUP_ROWS):
                if batch.num_rows == 0:
                    continue
                chunk = batch.column(batch.num_columns - 1)
                if schema is None:
                    schema = pa.schema([pa.field(f.name, pa.json_()) if f.name in json_cols else f
                                        for f in list(batch.schema)[:-1]])
                rows = pa.RecordBatch.from_arrays([c.cast(f.type) if f.name in json_cols else c
                                                   for c, f in zip(batch.columns[:-1], schema)], schema=schema)
                # the rows are in file order: cut the batch where the file changes
                cuts = [0]
                if batch.num_rows > 1:
                    changed = pc.not_equal(chunk.slice(1), chunk.slice(0, batch.num_rows - 1))
                    cuts += [int(i) + 1 for i in pc.indices_nonzero(changed).to_pylist()]
                cuts.append(batch.num_rows)
                for a, b in zip(cuts, cuts[1:]):
                    pending.append(pool.submit(out.add, f"{chunk[a].as_py()}.parquet", rows.slice(a, b - a)))
                while len(pending) > 8:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)
            pool.submit(out.close).result()
    return out.files


class _ChunkFiles:
    """The files ``_stream_chunks`` writes, one a chunk, in the order their rows come: whole row
    groups of ROW_GROUP_ROWS, the last of a file shorter."""

    def __init__(self, target: Path):
        self.target = target
        self.files: list[Path] = []
        self.writer = None
        self.held: list = []

    def add(self, name: str, rows) -> None:
        import pyarrow.parquet as pq

        if not self.files or self.files[-1].name != name:
            self.close()
            self.files.append(self.target / name)
            self.writer = pq.ParquetWriter(self.files[-1], rows.schema, compression="zstd", use_dictionary=True,
                                           dictionary_pagesize_limit=_DICTIONARY_PAGE)
        self.held.append(rows)
        self._flush()

    def _flush(self, final: bool = False) -> None:
        import pyarrow as pa

        n = sum(b.num_rows for b in self.held)
        if self.writer is None or not n or (n < ROW_GROUP_ROWS and not final):
            return
        t = pa.Table.from_batches(self.held)
        cut = n if final else n - n % ROW_GROUP_ROWS
        self.writer.write_table(t.slice(0, cut), row_group_size=ROW_GROUP_ROWS)
        self.held = t.slice(cut).to_batches() if cut < n else []

    def close(self) -> None:
        if self.writer is not None:
            try:
                self._flush(final=True)
            finally:
                self.writer.close()
                self.writer = None
                self.held = []


#: A column's dictionary page at most this large, then plain: an activation's values (few distinct
#: short decimals) take a dictionary, a 256-value embedding does not (pyarrow's default of 1 MB
#: made the explanations' files 7 % larger than DuckDB's own writer; at 16 KiB, the same size).
_DICTIONARY_PAGE = 16 << 10
