"""A batch: the inputs gathered, routed to the road that reads each, until the next validate +
load (bounded by bytes, activations and count)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from ..stages.land import Landed
from ..stages.records import ParsedInput
from ..stages.spool import Spool, close_all


class _Batch:
    """Inputs gathered until the next validate + load, bounded by bytes, activations and count."""

    def __init__(self) -> None:
        self.inputs: list[tuple[Landed, str, str | None]] = []  # landed, format, reject reason
        self.run_inputs: list[dict[str, str]] = []
        self.parsed: list[tuple[str, ParsedInput]] = []
        self.fast: list[Landed] = []  # single-line API JSON, left for DuckDB to read
        self.exports: dict[str, list[Landed]] = {}  # gzip export rows by table, left for DuckDB
        self.export_lines: dict[str, int] = {}  # newlines in each export file, by digest
        self.export_inexact: dict[str, list[int]] = {}  # ... its lines for the Python road (stage.LineCheck)
        self.export_fields: dict[str, frozenset[str]] = {}  # ... the fields of its lines the typed read lacks
        self.export_spools: dict[str, Spool] = {}  # ... its expanded bytes, kept aside until it is read
        self.bad_lines: list[dict[str, Any]] = []  # export lines that are not JSON objects, to quarantine
        self.taken: set[str] = set()  # digests this batch reads
        self.reread: list[str] = []  # of those, landed before (--reprocess, a limit raised, a newer capture)
        self.again: list[tuple[Landed, datetime]] = []  # bytes taken before, come again: decided at the flush
        self.retimes: dict[str, datetime] = {}  # bytes still loaded whose newer capture time is recorded
        self.retimed: dict[str, Landed] = {}  # ... and their inputs, read after all if the commit decides so
        self.n_activations = 0
        self.n_bytes = 0
        self.scratch: Path | None = None  # local copies of its S3 pages, for DuckDB to read

    def __len__(self) -> int:
        return (len(self.inputs) + len(self.run_inputs) + len(self.fast) + sum(map(len, self.exports.values()))
                + len(self.again))

    def free_copies(self) -> None:
        """Free the expanded copies of its export files (read, or the batch given up): each
        holds temporary disk and a file descriptor until closed."""
        close_all(self.export_spools)

    def add(self, landed: Landed, parsed: ParsedInput) -> None:
        self.inputs.append((landed, str(getattr(parsed.format, "value", parsed.format)), None))
        self.parsed.append((landed.sha256, parsed))
        self.n_activations += len(parsed.activations)

    def reject(self, landed: Landed, fmt: str, reason: str) -> None:
        self.inputs.append((landed, fmt, reason))
