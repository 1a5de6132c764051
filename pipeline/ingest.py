"""One ingest run: receive → land → parse → validate → load → materialise, in bounded batches.

``Pipeline``-style chaining only; each stage lives in its own module. Every input lands before
it is parsed; an input that cannot be parsed is recorded as rejected with its reason and the
run goes on; records that fail an expectation are quarantined. Memory stays bounded because
inputs are validated and loaded in batches of about ``settings.batch_activations`` activations.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
from tqdm import tqdm

from . import materialise, validate, warehouse
from .config import Settings
from .land import Landed, land
from .load import insert_rows, upsert, utcnow
from .parse import Rejected, parse_bytes
from .receive import Input, iter_inputs
from .records import ParsedInput, to_arrow

__all__ = ["RunSummary", "ingest", "new_run_id"]

log = logging.getLogger("featurehouse")

_MAX_INPUTS_PER_BATCH = 1000


def new_run_id(prefix: str = "run") -> str:
    """A sortable, unique run id: ``run-20261129T211500Z-1a2b3c``."""
    return f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"


@dataclass
class RunSummary:
    """What one ingest run did; ``as_dict()`` is small enough to pass between Airflow tasks."""

    run_id: str
    warehouse: str
    status: str = "running"
    n_received: int = 0
    n_landed: int = 0
    n_duplicates: int = 0
    n_loaded: int = 0
    n_rejected: int = 0
    n_features: int = 0
    n_activations: int = 0
    n_explanations: int = 0
    n_quarantined: int = 0
    n_expectations: int = 0
    n_expectations_failed: int = 0
    seconds: float = 0.0
    rejected: list[dict[str, str]] = field(default_factory=list)
    report_path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rejected"] = d["rejected"][:50]
        return d


_COUNTERS = (
    "n_received", "n_landed", "n_duplicates", "n_loaded", "n_rejected", "n_features",
    "n_activations", "n_explanations", "n_quarantined", "n_expectations", "n_expectations_failed",
)


class _Batch:
    """Inputs and their records gathered until the next validate + load."""

    def __init__(self) -> None:
        self.inputs: list[tuple[Landed, str, str | None]] = []  # landed, format, reject reason
        self.run_inputs: list[dict[str, str]] = []
        self.parsed: list[tuple[str, ParsedInput]] = []
        self.n_activations = 0

    def __len__(self) -> int:
        return len(self.inputs) + len(self.run_inputs)

    def add(self, landed: Landed, parsed: ParsedInput) -> None:
        self.inputs.append((landed, str(getattr(parsed.format, "value", parsed.format)), None))
        self.parsed.append((landed.sha256, parsed))
        self.n_activations += len(parsed.activations)

    def reject(self, landed: Landed, fmt: str, reason: str) -> None:
        self.inputs.append((landed, fmt, reason))


def _dedupe(items: list[tuple[str, Any]], key) -> list[tuple[str, Any]]:
    """Collapse records that arrive more than once with equal contents; keep the last copy.

    Copies of one key with *different* contents are all kept, so that the suite's uniqueness
    expectation refuses them instead of one silently winning.
    """
    by_key: dict[Any, list[int]] = {}
    keep = [True] * len(items)
    for i, (_, rec) in enumerate(items):
        k = key(rec)
        if k is None:
            continue
        earlier = by_key.setdefault(k, [])
        for j in earlier:
            if keep[j] and items[j][1] == rec:
                keep[j] = False
        earlier.append(i)
    return [it for it, k in zip(items, keep) if k]


def _last_by_key(items: list[tuple[str, Any]], key) -> list[tuple[str, Any]]:
    out: dict[Any, tuple[str, Any]] = {}
    for sha, rec in items:
        out[key(rec)] = (sha, rec)
    return list(out.values())


def _with_meta(table: pa.Table, shas: list[str], now) -> pa.Table:
    n = table.num_rows
    table = table.append_column("input_sha256", pa.array(shas, pa.string()))
    table = table.append_column("loaded_at", pa.array([now] * n, pa.timestamp("us")))
    return table


class _Run:
    def __init__(self, conn: duckdb.DuckDBPyConnection, settings: Settings, summary: RunSummary, reprocess: bool):
        self.conn = conn
        self.settings = settings
        self.summary = summary
        self.reprocess = reprocess
        self.batch_no = 0
        self.known = {
            sha for (sha,) in conn.execute("SELECT input_sha256 FROM raw_inputs").fetchall()
        }
        self.seen_this_run: set[str] = set()

    def flush(self, batch: _Batch) -> None:
        if not len(batch):
            return
        self.batch_no += 1
        conn, s, run_id, now = self.conn, self.summary, self.summary.run_id, utcnow()
        recs: dict[str, list[tuple[str, Any]]] = {t: [] for t in
            ("models", "source_sets", "sources", "features", "activations", "explanations")}
        for sha, p in batch.parsed:
            for table in recs:
                recs[table].extend((sha, r) for r in getattr(p, table))
        recs["models"] = _last_by_key(recs["models"], lambda r: r.model_id)
        recs["source_sets"] = _last_by_key(recs["source_sets"], lambda r: (r.model_id, r.source_set_name))
        recs["sources"] = _last_by_key(recs["sources"], lambda r: (r.model_id, r.source_id))
        recs["features"] = _dedupe(recs["features"], lambda r: (r.model_id, r.source_id, r.feature_index))
        recs["activations"] = _dedupe(recs["activations"], lambda r: r.activation_id)
        recs["explanations"] = _dedupe(recs["explanations"], lambda r: r.explanation_id)

        staged: dict[str, pa.Table] = {}
        for table in validate.SUITES:
            arrow = to_arrow(table, [r for _, r in recs[table]])
            arrow = arrow.append_column("_row", pa.array(range(arrow.num_rows), pa.int64()))
            if table == "activations":
                arrow = arrow.append_column("page_key", pa.array([r.page_key for _, r in recs[table]], pa.string()))
            staged[table] = arrow
            conn.register(f"stage_{table}", arrow)
        try:
            outcome = validate.validate_batch(conn, staged)
        finally:
            for table in staged:
                conn.unregister(f"stage_{table}")

        loaded_by_sha: dict[str, Counter] = {}
        conn.execute("BEGIN TRANSACTION")
        try:
            for table in ("models", "source_sets", "sources"):
                arrow = to_arrow(table, [r for _, r in recs[table]])
                upsert(conn, table, _with_meta(arrow, [sha for sha, _ in recs[table]], now))
            for table, arrow in staged.items():
                mask = outcome.passed[table]
                shas = [sha for sha, _ in recs[table]]
                good = arrow.filter(mask).drop_columns([c for c in ("_row", "page_key") if c in arrow.column_names])
                good_shas = [sha for sha, ok in zip(shas, mask.to_pylist()) if ok]
                good = _with_meta(good, good_shas, now)
                good = good.append_column("run_id", pa.array([run_id] * good.num_rows, pa.string()))
                upsert(conn, table, good)
                for sha in good_shas:
                    loaded_by_sha.setdefault(sha, Counter())[table] += 1
                setattr(s, f"n_{table}", getattr(s, f"n_{table}") + good.num_rows)

            quarantine = []
            for q in outcome.quarantine:
                sha, rec = recs[q["table"]][q["row"]]
                quarantine.append({
                    "run_id": run_id, "input_sha256": sha, "record_kind": q["record_kind"],
                    "record_key": q["record_key"], "check_name": q["check_name"], "detail": q["detail"],
                    "record_json": orjson.dumps(rec.raw, default=str, option=orjson.OPT_NON_STR_KEYS).decode(),
                    "quarantined_at": now,
                })
            insert_rows(conn, "quarantine", quarantine)
            s.n_quarantined += len({(q["table"], q["row"]) for q in outcome.quarantine})
            results = [dict(r, run_id=run_id, batch_no=self.batch_no, validated_at=now) for r in outcome.results]
            insert_rows(conn, "validation_results", results)
            s.n_expectations += len(results)
            s.n_expectations_failed += sum(not r["success"] for r in results)

            raw_rows = []
            for landed, fmt, reason in batch.inputs:
                counts = loaded_by_sha.get(landed.sha256, Counter())
                raw_rows.append({
                    "input_sha256": landed.sha256, "origin": landed.input.origin, "format": fmt,
                    "n_bytes": landed.n_bytes, "received_at": now, "run_id": run_id,
                    "status": "rejected" if reason else "loaded", "reason": reason,
                    "landed_path": str(landed.path),
                    "n_features": counts["features"], "n_activations": counts["activations"],
                    "n_explanations": counts["explanations"],
                })
                batch.run_inputs.append({"run_id": run_id, "input_sha256": landed.sha256,
                                         "origin": landed.input.origin,
                                         "outcome": "rejected" if reason else "loaded"})
            if raw_rows:
                upsert(conn, "raw_inputs", pa.Table.from_pylist(raw_rows))
            insert_rows(conn, "run_inputs", batch.run_inputs)
            conn.execute(
                "UPDATE runs SET " + ", ".join(f"{c} = ${c}" for c in _COUNTERS) + " WHERE run_id = $run_id",
                {c: getattr(s, c) for c in _COUNTERS} | {"run_id": run_id},
            )
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise
        self.known.update(landed.sha256 for landed, _, _ in batch.inputs)

    def take(self, item: Input, batch: _Batch) -> None:
        s = self.summary
        s.n_received += 1
        landed = land(item, self.settings.landing_dir, self.settings.max_input_bytes)
        if (landed.sha256 in self.known and not self.reprocess) or landed.sha256 in self.seen_this_run:
            s.n_duplicates += 1
            batch.run_inputs.append({"run_id": s.run_id, "input_sha256": landed.sha256,
                                     "origin": item.origin, "outcome": "duplicate"})
            return
        self.seen_this_run.add(landed.sha256)
        if landed.sha256 not in self.known:
            s.n_landed += 1
        if landed.data is None:
            reason = (
                f"input is {landed.n_bytes:,} bytes, over the {self.settings.max_input_bytes:,}-byte "
                "limit (FEATUREHOUSE_MAX_INPUT_BYTES); it is landed but was not parsed"
            )
            self._reject(batch, landed, "unknown", reason)
            return
        try:
            parsed = parse_bytes(landed.data, self.settings)
        except Rejected as exc:
            self._reject(batch, landed, "unknown", str(exc))
        except RecursionError:
            self._reject(batch, landed, "unknown", "input is nested too deeply to parse; refused")
        except Exception as exc:  # a parser bug must not stop the run; the input stays landed
            log.exception("unexpected error parsing %s", item.origin)
            self._reject(batch, landed, "unknown", f"could not be parsed ({type(exc).__name__}: {exc})")
        else:
            s.n_loaded += 1
            batch.add(landed, parsed)

    def _reject(self, batch: _Batch, landed: Landed, fmt: str, reason: str) -> None:
        self.summary.n_rejected += 1
        self.summary.rejected.append({"origin": landed.input.origin, "reason": reason})
        batch.reject(landed, fmt, reason)


def _expand(inputs: Iterable[str | os.PathLike | Input]) -> tuple[Iterable[Input], int | None]:
    """Paths become their files (listed up front, for a progress total); Inputs pass through lazily."""
    if isinstance(inputs, (list, tuple)):
        if all(isinstance(i, Input) for i in inputs):
            return inputs, len(inputs)
        files: list[Input] = []
        for i in inputs:
            files.extend([i] if isinstance(i, Input) else iter_inputs([i]))
        return files, len(files)
    return (i if isinstance(i, Input) else Input(origin=str(i), path=Path(i)) for i in inputs), None


def ingest(
    inputs: Iterable[str | os.PathLike | Input],
    settings: Settings | None = None,
    *,
    run_id: str | None = None,
    trigger: str = "cli",
    reprocess: bool = False,
    progress: bool | None = None,
    materialise_after: bool = True,
) -> RunSummary:
    """Ingest files, folders or in-memory inputs into the warehouse, and return what happened.

    Re-sending bytes already landed changes nothing (they are counted as duplicates) unless
    ``reprocess`` is set. Raises only when the run itself fails (the warehouse cannot be
    written); bad inputs are recorded, never raised.
    """
    settings = settings or Settings.from_env()
    todo, total = _expand(inputs)
    run_id = run_id or new_run_id()
    summary = RunSummary(run_id=run_id, warehouse=str(settings.warehouse))
    started = time.monotonic()
    conn = warehouse.connect(settings.warehouse)
    try:
        existing = conn.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if existing:
            conn.execute("UPDATE runs SET status = 'running', started_at = ?, finished_at = NULL, error = NULL WHERE run_id = ?", [utcnow(), run_id])
        else:
            conn.execute("INSERT INTO runs (run_id, started_at, status, trigger) VALUES (?, ?, 'running', ?)",
                         [run_id, utcnow(), trigger])
        run = _Run(conn, settings, summary, reprocess)
        batch = _Batch()
        show = progress if progress is not None else (total is None or total > 20)
        with tqdm(total=total, unit="input", disable=not show, desc="ingest") as bar:
            for item in todo:
                run.take(item, batch)
                bar.update(1)
                if batch.n_activations >= settings.batch_activations or len(batch) >= _MAX_INPUTS_PER_BATCH:
                    run.flush(batch)
                    batch = _Batch()
                bar.set_postfix(loaded=summary.n_loaded, rejected=summary.n_rejected, refresh=False)
            run.flush(batch)
        if materialise_after:
            materialise.refresh(conn, run_id)
        summary.status = "succeeded"
    except BaseException as exc:
        summary.status = "failed"
        try:
            conn.execute("UPDATE runs SET status = 'failed', finished_at = ?, error = ? WHERE run_id = ?",
                         [utcnow(), f"{type(exc).__name__}: {exc}", run_id])
        except duckdb.Error:
            pass
        conn.close()
        raise
    summary.seconds = round(time.monotonic() - started, 3)
    conn.execute("UPDATE runs SET status = ?, finished_at = ? WHERE run_id = ?", [summary.status, utcnow(), run_id])
    conn.close()
    return summary
