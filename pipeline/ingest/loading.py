"""The loader thread's work: a batch staged, read and judged on its connection is written,
committed (one transaction, one snapshot, under the commit lock) and forgotten, while the main
thread readies the next batch on the other connection. What the run hands to the loader is one
:class:`LoadJob`; what the loader keeps across batches (the inputs a commit sent back to be
read) is on the :class:`_Loader`. A batch of inputs all seen before is committed here too
(``record_seen``), in the main thread."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from ..config import Settings
from ..lake import s3, warehouse
from ..lake.runstate import COUNTERS, RunSummary, write_counts
from ..lake.s3 import is_s3
from ..lake.sqltext import insert_values
from ..stages import materialise, stage, validate
from ..stages.captures import DATA_TABLES, retime_checked
from ..stages.land import Landed
from ..stages.load import (
    REFERENCE_KEYS,
    STAGED_ACTIVATIONS,
    delete,
    forget_decided,
    insert_rows,
    prestats,
    prewrite,
    record_captures,
    replace_staged,
    upsert_reference,
)
from .batch import _Batch

log = logging.getLogger("featurehouse")

_DATA_TABLES = tuple(validate.SUITES)
assert set(_DATA_TABLES) == set(DATA_TABLES)


@dataclass(frozen=True)
class LoadJob:
    """What the run hands to the loader thread for one batch: the connection it was staged on
    (the loader's until the batch is committed), the batch, Great Expectations' verdict on it,
    the rival captures ``claim_captures`` superseded, the time it was received, its number, and
    the run's counts as of this batch (the main thread counts the next one meanwhile)."""

    conn: duckdb.DuckDBPyConnection
    batch: _Batch
    outcome: validate.ValidationOutcome
    superseded: list[dict]
    now: datetime
    batch_no: int
    base: dict[str, int]


def _forget(conn: duckdb.DuckDBPyConnection, batch: _Batch) -> None:
    """A batch's staging tables and scratch copies, once it is loaded (or failed): quarantined
    records are cut out of these copies at the load."""
    stage.drop(conn)
    batch.free_copies()  # (read already, but for a batch failed before its read)
    if batch.scratch is not None:
        shutil.rmtree(batch.scratch, ignore_errors=True)


class _Loader:
    """Loads the batches the run hands it, one at a time, in batch order (see ``_Run``)."""

    def __init__(self, settings: Settings, summary: RunSummary, reprocess: bool, materialise: bool,
                 source_stats: bool, captured: dict[str, datetime], on_write: Callable[[], None]):
        self.settings = settings
        self.summary = summary
        self.reprocess = reprocess
        self.materialise = materialise
        self.source_stats = source_stats
        self.captured = captured  # input digest → when this capture was made (the intake's)
        self.on_write = on_write  # called when a batch's load begins writing its files
        self.requeued: list[tuple[Landed, datetime]] = []  # inputs a commit sent back to be read (_requeue)

    def load_batch(self, job: LoadJob):
        """The loader thread's work for one batch: load it, then drop its staging tables."""
        try:
            return self._load(job)
        finally:
            _forget(job.conn, job.batch)

    def record_seen(self, conn: duckdb.DuckDBPyConnection, batch: _Batch) -> None:
        """Commit the run_inputs rows of a batch of inputs all landed before, and the run's counts
        (in the main thread, on the connection it stages on; no batch is loading)."""
        s, run_id = self.summary, self.summary.run_id

        def body(conn: duckdb.DuckDBPyConnection) -> tuple[dict[str, float], list[str]]:
            moved = retime_checked(conn, batch.retimes)
            rows, undone = self._without_moved(batch.run_inputs, moved)
            insert_values(conn, "run_inputs", rows)
            counts = {c: getattr(s, c) for c in COUNTERS} | s.sync_commit_stats()
            counts["n_duplicates"] -= undone  # read after all, after this commit
            write_counts(conn, s, counts)  # a part adds its own; never overwrites the other parts'
            return counts, moved

        counts, moved = warehouse.transaction(conn, self.settings, body,
                                              message=f"run {run_id} inputs seen before",
                                              extra={"run_id": run_id}, stats=s.stats)
        s.n_duplicates -= self._requeue(batch, moved)
        if s.part is not None:
            s.written = counts

    @staticmethod
    def _failed_rows(conn: duckdb.DuckDBPyConnection, outcome: validate.ValidationOutcome) -> list[tuple[str, int]]:
        """The staged rows Great Expectations refused, ``(table, _row)``, also as the temp table
        ``failed_rows`` (the batch's write leaves them out)."""
        failed = sorted({(q["table"], q["row"]) for q in outcome.quarantine})
        conn.register("_failed", pa.table({"tbl": pa.array([t for t, _ in failed], pa.string()),
                                           "_row": pa.array([r for _, r in failed], pa.int64())}))
        conn.execute("CREATE OR REPLACE TEMP TABLE failed_rows AS SELECT * FROM _failed")
        conn.unregister("_failed")
        return failed

    @staticmethod
    def _export_files(batch: _Batch) -> dict[str, Path]:
        """The batch's local export files whose rows are their lines (none of them set aside)."""
        set_aside = {q["input_sha256"] for q in batch.bad_lines}
        return {landed.sha256: Path(landed.path) for group in batch.exports.values() for landed in group
                if not is_s3(landed.path) and landed.sha256 not in set_aside}

    def _bookkeeping(self, job: LoadJob, failed: list[tuple[str, int]],
                     lines: dict[str, dict[int, tuple[str, str]]]) -> tuple[list, list, list]:
        """What the commit records beside the rows, prepared before it (none of it needs the
        committed state): the quarantined records as received (``lines``: the refused export
        rows' lines, cut out of their files per table), the expectation results and the run's
        inputs."""
        conn, batch, outcome, now, batch_no = job.conn, job.batch, job.outcome, job.now, job.batch_no
        run_id = self.summary.run_id
        raw_by_row = {}
        export_files = self._export_files(batch)
        for table in _DATA_TABLES:
            raws = stage.raw_records(conn, table, [r for t, r in failed if t == table], export_files,
                                     lines=lines.get(table, {}))
            raw_by_row.update({(table, r): v for r, v in raws.items()})
        quarantine = [dict(q, run_id=run_id, quarantined_at=now) for q in batch.bad_lines]
        for q in outcome.quarantine:
            sha, raw = raw_by_row[(q["table"], q["row"])]
            quarantine.append({
                "run_id": run_id, "input_sha256": sha, "record_kind": q["record_kind"],
                "record_key": q["record_key"], "check_name": q["check_name"], "detail": q["detail"],
                "record_json": raw, "quarantined_at": now,
            })
        results = [dict(r, run_id=run_id, batch_no=batch_no, validated_at=now) for r in outcome.results]
        run_inputs = list(batch.run_inputs) + [
            {"run_id": run_id, "input_sha256": landed.sha256, "origin": landed.input.origin,
             "outcome": "rejected" if reason else "loaded"}
            for landed, _, reason in batch.inputs
        ]
        return quarantine, results, run_inputs

    def _load(self, job: LoadJob) -> tuple[dict, dict]:
        """Commit the batch (in the loader thread, on the connection it was staged on): one
        transaction, one snapshot, under the commit lock, retried whole if it loses a commit
        race. Everything that need not see the committed state (the quarantined records as
        received, the bookkeeping rows) is prepared before it. ``job.base``: the run's counts as of
        this batch (the main thread counts the next one meanwhile). Returns what it loaded and
        the counts it stored."""
        conn, batch, outcome, now, batch_no = job.conn, job.batch, job.outcome, job.now, job.batch_no
        superseded, base = job.superseded, job.base
        s, run_id = self.summary, self.summary.run_id
        failed = self._failed_rows(conn, outcome)
        shas = [landed.sha256 for landed, _, _ in batch.inputs]
        # The refused export rows' lines are cut out of their gzip files (a second or two of one
        # core for a 1 GiB batch) in a thread, beside the batch's Parquet write, whose end runs
        # on one core; the plan reads the staged table, so it is made here, before the write.
        export_files = self._export_files(batch)
        plans = {t: stage.plan_export_lines(conn, t, [r for tt, r in failed if tt == t], export_files)
                 for t in _DATA_TABLES}
        with contextlib.ExitStack() as stack:
            cutting = {}
            if any(p.wanted for p in plans.values()):
                pool = stack.enter_context(futures.ThreadPoolExecutor(1, thread_name_prefix="cut-lines"))
                cutting = {t: pool.submit(stage.cut_export_lines, p) for t, p in plans.items() if p.wanted}

            # The batch's rows are written before the commit lock is taken; the commit adds the
            # files to the catalog (and writes the rows itself only where another writer's
            # commit since changed what loads): the lock is held for metadata, not for writing.
            with s.timed("write"):
                prewritten = prewrite(conn, now, run_id, reprocess=self.reprocess, inputs=shas,
                                      on_write=self.on_write)
            if batch.retimes:
                prewritten.snapshot = -1  # the commit moves capture times first: it decides again after
            elif self.materialise:  # the changed features' statistics too, before the lock
                with s.timed("stats"):
                    prestats(conn, prewritten)
            lines = {t: f.result() for t, f in cutting.items()}
        quarantine, results, run_inputs = self._bookkeeping(job, failed, lines)

        def body(conn: duckdb.DuckDBPyConnection) -> dict[str, int]:
            moved = retime_checked(conn, batch.retimes)
            loaded, older = replace_staged(conn, now, run_id, reprocess=self.reprocess, prewritten=prewritten)
            record_captures(conn, now, run_id, prewritten)
            for table in REFERENCE_KEYS:  # (decided before the lock, unless a commit came in between)
                upsert_reference(conn, table, now, decided=prewritten.reference.get(table) if prewritten.stood else None)
            if self.materialise:  # stats of the features this batch changed, in the same snapshot
                with s.timed("stats"):  # (computed before the lock, if no commit came in between)
                    materialise.refresh_changed(conn, sources=self.source_stats, staged=STAGED_ACTIVATIONS,
                                                computed=prewritten.stats and prewritten.stood,
                                                nothing_to_delete=prewritten.skipped())
            gone = [dict(r, run_id=run_id, recorded_at=now) for r in superseded + older]
            insert_rows(conn, "superseded", gone)
            # An input parsed again (--reprocess) re-derives its quarantine: replace, never duplicate.
            delete(conn, "quarantine", prewritten, {"shas": shas})
            insert_rows(conn, "quarantine", quarantine)
            insert_rows(conn, "validation_results", results)
            self._record_inputs(conn, batch, loaded, now, known="raw_inputs" not in prewritten.skipped())
            rows, undone = self._without_moved(run_inputs, moved)
            insert_values(conn, "run_inputs", rows)
            delta = {f"n_{t}": sum(loaded[t].values()) for t in _DATA_TABLES}
            delta |= {"n_quarantined": len(failed) + len(batch.bad_lines), "n_superseded": len(gone),
                      "n_expectations": len(results), "n_expectations_failed": sum(not r["success"] for r in results),
                      "n_duplicates": -undone}
            counts = {c: base[c] + delta.get(c, 0) for c in COUNTERS} | s.sync_commit_stats()
            write_counts(conn, s, counts)
            return delta, counts, moved

        with s.timed("commit"):
            delta, counts, moved = warehouse.transaction(conn, self.settings, body,
                                                         message=f"run {run_id} batch {batch_no}",
                                                         extra={"run_id": run_id, "batch": batch_no}, stats=s.stats)
        self._requeue(batch, moved)  # (the count of 'duplicate' rows it undid is in delta)
        materialise.forget_computed(conn)
        forget_decided(conn)
        # committed: a file the commit did not add is no table's (after a failure, all of them
        # stay for `maintain` to delete: whether a failed commit added them is not known here)
        for path in prewritten.unused():
            try:
                s3.delete(path, self.settings) if is_s3(path) else os.unlink(path)
            except Exception as exc:  # an orphan: maintain deletes it later
                log.warning("could not remove the unused data file %s: %s", path, exc)
        return delta, counts

    def _record_inputs(self, conn: duckdb.DuckDBPyConnection, batch: _Batch, loaded: dict, now,
                       known: bool = True) -> None:
        """The batch's inputs in ``raw_inputs``, in the commit: what each loaded (``loaded``: rows
        per table and input digest) or why it was rejected. ``known=False``: none of them is
        there yet (found before the lock, against the snapshot the commit still reads).

        An input whose rows this commit did not load may hold rows all the same: another writer
        loaded the same bytes between this batch's decision and its commit (two ingests of one
        file at once). Its counts are what the tables hold of it, read under the lock, not the
        commit's zero (the row said 'loaded' with 0 activations while 40 were held)."""
        run_id, raw_rows = self.summary.run_id, []
        none_loaded = sorted({landed.sha256 for landed, _, reason in batch.inputs if reason is None
                              and any(not loaded[t].get(landed.sha256) for t in _DATA_TABLES)})
        held: dict[str, dict[str, int]] = {t: {} for t in _DATA_TABLES}
        if none_loaded and known:
            for t in _DATA_TABLES:
                held[t] = dict(warehouse.execute(
                    conn, f"SELECT input_sha256, count(*) FROM {t} WHERE list_contains(?, input_sha256) GROUP BY 1",
                    [none_loaded]).fetchall())
        for landed, fmt, reason in batch.inputs:
            raw_rows.append({
                "input_sha256": landed.sha256, "origin": landed.input.origin, "format": fmt,
                "n_bytes": landed.n_bytes, "received_at": now, "run_id": run_id,
                "captured_at": self.captured.get(landed.sha256),
                "status": "rejected" if reason else "loaded", "reason": reason,
                "landed_path": str(landed.path),
                **{f"n_{t}": loaded[t].get(landed.sha256) or held[t].get(landed.sha256, 0) for t in _DATA_TABLES},
            })
        if raw_rows:
            # An input read again keeps its first origin, run and receipt time; what parsing
            # decided (format, status, reason, counts) is updated, and its capture time is the
            # newest of its bytes'.
            conn.register("_raw_rows", pa.Table.from_pylist(raw_rows))
            if known:
                conn.execute(
                    """UPDATE raw_inputs AS t SET format = s.format, status = s.status, reason = s.reason,
                              n_features = s.n_features, n_activations = s.n_activations,
                              n_explanations = s.n_explanations, captured_at = greatest(t.captured_at, s.captured_at)
                       FROM _raw_rows AS s WHERE t.input_sha256 = s.input_sha256"""
                )
            conn.execute("INSERT INTO raw_inputs BY NAME SELECT * FROM _raw_rows"
                         + (" WHERE input_sha256 NOT IN (SELECT input_sha256 FROM raw_inputs)" if known else ""))
            conn.unregister("_raw_rows")

    @staticmethod
    def _without_moved(run_inputs: list[dict], moved: list[str]) -> tuple[list[dict], int]:
        """The run_inputs rows less the 'duplicate' ones of inputs the commit decided to read
        after all (they are read after it, and recorded then); and how many were left out."""
        if not moved:
            return run_inputs, 0
        rows = [r for r in run_inputs if not (r["outcome"] == "duplicate" and r["input_sha256"] in moved)]
        return rows, len(run_inputs) - len(rows)

    def _requeue(self, batch: _Batch, moved: list[str]) -> int:
        """Inputs whose retime the commit found moved (see ``captures.retime_checked``): read again in
        a batch after this one (``requeued``); returns how many 'duplicate' rows that undid."""
        undone = 0
        for sha in moved:
            self.requeued.append((batch.retimed[sha], batch.retimes[sha]))
            undone += sum(r["outcome"] == "duplicate" and r["input_sha256"] == sha for r in batch.run_inputs)
        if moved:
            log.info("%d input(s) decided 'only move the capture time' lost their features to another writer's "
                     "commit in between: read again", len(moved))
        return undone
