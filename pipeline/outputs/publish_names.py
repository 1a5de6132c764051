"""What a publication is called and what it reports: the tables it holds unless told otherwise
and the columns it leaves out (``DEFAULT_TABLES``, ``PRIVATE_COLUMNS``), the names it makes in
DEST (the catalog, the lock, ``hf/``'s mark, the scratch), :class:`PublishRefused`, and
:class:`Published`: what was written, and the lines that open it. The other ``publish_*``
modules build on these; :mod:`pipeline.outputs.publish` says how the whole fits together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

#: The tables a publication holds unless told otherwise: the data and its statistics.
DEFAULT_TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations",
                  "feature_activation_stats", "feature_token_stats", "source_activation_stats")

#: Columns left out unless ``include_private``: where inputs came from (paths, URLs with hosts),
#: who ran a run (host, pid), errors that quote paths, and where reports were written.
PRIVATE_COLUMNS = {
    "runs": ("host", "pid", "error", "report_path"),
    "raw_inputs": ("origin", "reason", "landed_path"),
    "run_inputs": ("origin",),
    "fetch_failures": ("url", "last_error"),
}

#: Tables never published: the schema's own bookkeeping.
NEVER = ("schema_version",)

CATALOG_FILE = "featurehouse.ducklake"
LOCK_FILE = ".publish.lock"
#: In ``hf/``: which warehouse snapshot each table's files hold (written after them).
HF_MARK = ".published.json"
#: What a publication's scratch is named (``.featurehouse-<pid>-...``): only ever removed under the lock.
SCRATCH = ".featurehouse-"
#: What a publication makes in DEST, besides its scratch.
MADE = (CATALOG_FILE, LOCK_FILE, "data", "hf")
PUB = "fh_publish"
_KEY = ("model_id", "source_id", "feature_index")
#: Rows per Parquet row group of the published files (DuckDB's writer flushes at multiples of its
#: 2,048-row vectors): a one-feature lookup over HTTP reads the row group that holds it.
ROW_GROUP_ROWS = 2048


class PublishRefused(ValueError):
    """A publication that would leak, overwrite the warehouse or cannot be made: said in one line."""


@dataclass
class TableDone:
    table: str
    rows: int
    how: str  # "new" | "whole" | "changes" | "unchanged"
    added: int = 0
    removed: int = 0
    why: str = ""


@dataclass
class Published:
    dest: Path
    snapshot_id: int
    snapshot_time: datetime
    formats: tuple[str, ...]
    tables: list[TableDone] = field(default_factory=list)
    bytes_written: int = 0
    files_written: int = 0
    bytes_by_format: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False
    url: str | None = None
    seconds: float = 0.0
    #: The snapshot the DuckLake held before, when its change feed was applied ("" otherwise)
    base: str = ""
    #: ``s3://bucket/prefix`` when published there (``dest`` is then the local folder it was built in)
    remote: str = ""
    #: What was sent to (or, a dry run, would be sent to) ``remote``: a ``publish_s3.Upload``
    upload: Any = None
    #: The S3 endpoint of ``remote`` when not AWS's (``http://host:port``), for the secret a reader makes
    endpoint: str | None = None

    @property
    def catalog(self) -> Path:
        return self.dest / CATALOG_FILE

    @property
    def where(self) -> str:
        """Where it was published: ``s3://bucket/prefix`` or the folder."""
        return self.remote or str(self.dest)

    def lines(self) -> list[str]:
        """The lines that open the publication, as a reader pastes them (quotes doubled for SQL,
        escaped for Python)."""
        out: list[str] = []
        sql = lambda v: str(v).replace("'", "''")  # noqa: E731
        py = lambda v: str(v).replace("\\", "\\\\").replace("'", "\\'")  # noqa: E731
        if "ducklake" in self.formats:
            if self.url and self.url.startswith("s3://"):
                out.append("-- DuckDB (INSTALL ducklake; INSTALL httpfs; once), with an S3 secret for the bucket, e.g.")
                out.append("-- CREATE SECRET (TYPE s3, PROVIDER credential_chain" + self._endpoint_opts() + ");")
            elif self.url:
                out.append("-- DuckDB (INSTALL ducklake; INSTALL httpfs; once):")
            if self.url:
                out.append(f"ATTACH 'ducklake:{sql(self.url)}/{CATALOG_FILE}' AS fh (READ_ONLY);")
            else:
                out.append("-- DuckDB, this folder in place (served over HTTP: publish with --url):")
                out.append(f"ATTACH 'ducklake:{sql(self.catalog)}' AS fh (READ_ONLY, DATA_PATH '{sql(self.dest)}/data/', "
                           "OVERRIDE_DATA_PATH true);")
        if "hf" in self.formats:
            base = py(f"{self.url}/hf" if self.url else self.dest / "hf")
            out.append("# pandas:")
            out.append(f"pd.read_parquet('{base}/features')" if not self.url else
                       f"pd.read_parquet('{base}/features/data_0.parquet')")
            out.append("# Hugging Face datasets (or load_dataset('ORG/NAME', 'features') once pushed to the Hub):")
            out.append(f"datasets.load_dataset('{base}', 'features')" if not self.url else
                       f"datasets.load_dataset('parquet', data_files='{base}/features/*.parquet')")
        return out

    def _endpoint_opts(self) -> str:
        """A DuckDB S3 secret's options for ``endpoint`` ('' for AWS itself)."""
        if not self.endpoint:
            return ""
        scheme, _, host = self.endpoint.rpartition("://")
        host = host.rstrip("/").replace("'", "''")
        return f", ENDPOINT '{host}', URL_STYLE 'path', USE_SSL {'false' if scheme == 'http' else 'true'}"
