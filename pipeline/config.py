"""Run-time settings: one typed class, resolved from the environment, then defaults."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path


def _schemas_dir() -> Path:
    """The JSON Schemas, DDL, aggregate SQL and expectation suites: ``$FEATUREHOUSE_SCHEMAS``, else
    ``schemas/`` of the checkout this package is in, else the copy a wheel installs inside it."""
    if os.environ.get("FEATUREHOUSE_SCHEMAS"):
        return Path(os.environ["FEATUREHOUSE_SCHEMAS"])
    here = Path(__file__).resolve().parent
    checkout = here.parent / "schemas"
    return checkout if (checkout / "migrations").is_dir() else here / "schemas"


SCHEMAS_DIR = _schemas_dir()
DEFAULT_WAREHOUSE = Path("warehouse")


class BadSetting(ValueError):
    "A setting (an environment variable, featurehouse.toml) holds a value it cannot take: not transient."


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadSetting(f"{name} must be a whole number, got {raw!r}") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise BadSetting(f"{name} must be a number, got {raw!r}") from None


def _env_str(name: str) -> str | None:
    raw = os.environ.get(name)
    return raw.strip() if raw and raw.strip() else None


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = _env_str(name)
    if raw is None:
        return default
    if raw.lower() not in choices:
        raise BadSetting(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw.lower()


#: A PostgreSQL password: libpq's ``password=...`` (quoted or not), a URL's ``user:password@``.
_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(postgres(?:ql)?(?:\+\w+)?://[^:/@\s]*:)([^@\s]+)(@)", re.IGNORECASE)


def without_password(text: str) -> str:
    """``text`` with every PostgreSQL password in it (libpq ``password=...``, a URL's) as ``***``:
    for anything shown or logged (``featurehouse config``, error messages, the web app)."""
    return _URL_PASSWORD.sub(r"\1***\3", _PASSWORD.sub(r"\1***", text))


def postgres_catalog(catalog: str) -> str:
    """A PostgreSQL catalog setting as DuckLake takes it: ``postgres:`` and a libpq string or URL.
    ``postgresql://...`` and ``postgres://...`` (a bare URL) and ``postgresql:dbname=...`` name
    the same catalog as ``postgres:postgresql://...`` and ``postgres:dbname=...``; any other
    text is returned as it is."""
    low = catalog.lower()
    if low.startswith(("postgresql://", "postgres://")):
        return "postgres:" + catalog
    if low.startswith("postgresql:"):
        return "postgres:" + catalog.split(":", 1)[1]
    if low.startswith("postgres:") and not catalog.startswith("postgres:"):  # POSTGRES:...
        return "postgres:" + catalog.split(":", 1)[1]
    return catalog


#: The values of ``Settings.data_docs``.
DATA_DOCS = ("run", "report")


@dataclass(frozen=True)
class Settings:
    """Where the warehouse lives and the limits an ingest run enforces."""

    warehouse: Path = field(default=DEFAULT_WAREHOUSE)
    """The warehouse folder; `$FEATUREHOUSE_WAREHOUSE`, else ./warehouse. Holds the embedded
    catalog (catalog.sqlite), the Parquet data (data/), the landing area, reports and Great
    Expectations' files, unless the settings below put some of them elsewhere."""

    catalog: str | None = None
    """The DuckLake catalog: `sqlite:<file>` or `postgres:<libpq connection string or URL>`
    (`postgres:dbname=... host=...`, `postgres:postgresql://user:pw@host:port/db`; a bare
    `postgresql://...` URL is taken as the latter); `$FEATUREHOUSE_CATALOG`, else
    `sqlite:<warehouse>/catalog.sqlite`. Its password is never shown (`featurehouse config`
    prints `***`)."""

    data_path: str | None = None
    """Where DuckLake writes Parquet data files: a folder or `s3://bucket/prefix/`;
    `$FEATUREHOUSE_DATA_PATH`, else `<warehouse>/data/`. Read from the catalog once it exists."""

    landing: str | None = None
    """The content-addressed landing area: a folder or `s3://bucket/prefix/`;
    `$FEATUREHOUSE_LANDING`, else `<warehouse>/landing`."""

    retention_days: int = 90
    """Snapshots (history) older than this are expired by `featurehouse maintain`;
    `$FEATUREHOUSE_RETENTION_DAYS`."""

    max_input_bytes: int = 256 * 1024 * 1024
    """Largest input accepted for parsing, as received; `$FEATUREHOUSE_MAX_INPUT_BYTES`."""

    max_decompressed_bytes: int = 1024 * 1024 * 1024
    """Largest size a gzip input may expand to; past it the input is refused
    (guards against gzip bombs); `$FEATUREHOUSE_MAX_DECOMPRESSED_BYTES`."""

    batch_activations: int = 20_000
    """Activations gathered before a batch is validated and loaded (bounds memory);
    `$FEATUREHOUSE_BATCH_ACTIVATIONS`."""

    batch_bytes: int = 48 * 1024 * 1024
    """Input bytes gathered before a batch is validated and loaded (bounds memory: two batches
    are in hand at once, one loading while the next is read and validated). Measured on 2 cores,
    1,000 pages (270 MB), with DuckDB's allocator on one arena: 48 MiB 0.86 of 32 MiB's wall
    (0.85 of its CPU; four alternating pairs), peak RSS 1.25-1.35 GB against 1.1 GB; 64 MiB no
    faster than 48 (0.92, 0.79-1.12) at 1.35-1.45 GB, too near the 1.5 GB bound; 16 MiB slower
    (more fixed costs a batch). An export file's expanded bytes count 3/8 (DuckDB streams them
    into its columns: 128 MiB of them a batch by default; ``ingest.intake.EXPORT_BYTES_SHARE``);
    `$FEATUREHOUSE_BATCH_BYTES`."""

    bytes_per_thread: int = 64 * 1024 * 1024
    """An ingest gives DuckDB one worker thread per this many input bytes of the batch in hand
    (at least one, at most one per core): a page or a default batch runs on one thread, a
    gigabyte export batch on every core. Measured on 2 cores: batches of 3-45 MB ran as fast or
    faster on one thread with 17-35% less CPU (threads spin on small statements);
    `$FEATUREHOUSE_BYTES_PER_THREAD` (0: always every core)."""

    input_digest_days: float = 7.0
    """How long an input file's digest is trusted without reading the file again, while its
    ``stat`` (path, device, inode, size, modification and change times) is unchanged: an
    unchanged re-run reads nothing (``<warehouse>/.input-digests.sqlite``). After this many days
    since the file was hashed, it is read and hashed again. 0: every input is read and hashed at
    every run (for inputs written in ways ``stat`` does not show, e.g. through a memory map held
    open); `$FEATUREHOUSE_INPUT_DIGEST_DAYS`."""

    reports_dir: Path | None = None
    """Where HTML reports go; `$FEATUREHOUSE_REPORTS`, else `reports/` in the warehouse folder."""

    commit_attempts: int = 8
    """Attempts of a load transaction that lost a commit race (a conflict in the catalog)
    before the run fails; `$FEATUREHOUSE_COMMIT_ATTEMPTS`."""

    lock_timeout: float = 3600.0
    """Seconds a writer waits for the warehouse's commit lock; `$FEATUREHOUSE_LOCK_TIMEOUT`."""

    s3_endpoint: str | None = None
    """An S3-compatible endpoint for `s3://` data and landing (MinIO, a test server), e.g.
    `http://minio:9000`; `$FEATUREHOUSE_S3_ENDPOINT`, else `$AWS_ENDPOINT_URL_S3`, else
    `$AWS_ENDPOINT_URL`, else AWS itself. Credentials are never settings: they come from the
    standard AWS variables or chain (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, a profile, a role)."""

    s3_region: str = "us-east-1"
    """The S3 region; `$AWS_REGION`, else `$AWS_DEFAULT_REGION`."""

    find_dir: Path | None = None
    """Where the find index lives (the derived DuckDB file `featurehouse search`, `similar`,
    `by-token` and `show` read, rebuilt from the warehouse at will): always on this machine's
    disk; `$FEATUREHOUSE_FIND_DIR`, else `find/` in the warehouse folder."""

    data_docs: str = "report"
    """When Great Expectations records a run's results and builds its Data Docs: `report` (by
    `featurehouse report` and the nightly DAG's report task, which record every run's waiting
    results; an ingest imports no Great Expectations, ~6 CPU-s a process on a slow machine, and
    its results, judged by DuckDB, wait as JSON under the Great Expectations folder until then),
    or `run` (with the run's own report, in `ingest` and every DAG run); `$FEATUREHOUSE_DATA_DOCS`."""

    @property
    def catalog_url(self) -> str:
        """The catalog as DuckLake names it after ``ducklake:`` (``sqlite:...`` or ``postgres:...``)."""
        return postgres_catalog(self.catalog) if self.catalog else f"sqlite:{(self.warehouse / 'catalog.sqlite').absolute()}"

    @property
    def catalog_kind(self) -> str:
        kind = self.catalog_url.split(":", 1)[0].lower()
        return "postgres" if kind in ("postgres", "postgresql") else kind

    @property
    def data_url(self) -> str:
        """Where new Parquet files go (a folder ending in ``/`` or an ``s3://`` prefix)."""
        if self.data_path:
            return self.data_path if self.data_path.endswith("/") else self.data_path + "/"
        return f"{(self.warehouse / 'data').absolute()}/"

    @property
    def landing_url(self) -> str:
        return self.landing or str((self.warehouse / "landing").absolute())

    @property
    def landing_dir(self) -> Path:
        """The landing area as a local folder; ValueError when it is on S3 (``landing_root``
        serves both)."""
        if self.landing_url.startswith("s3://"):
            raise ValueError(f"the landing area {self.landing_url} is on S3, not a local folder")
        return Path(self.landing_url)

    @property
    def landing_root(self) -> Path | str:
        """The landing area: a local folder, or an ``s3://bucket/prefix`` URL (a string)."""
        url = self.landing_url
        return url.rstrip("/") if url.startswith("s3://") else Path(url)

    @property
    def find_index_dir(self) -> Path:
        return self.find_dir if self.find_dir is not None else self.warehouse / "find"

    @property
    def report_dir(self) -> Path:
        return self.reports_dir if self.reports_dir is not None else self.warehouse / "reports"

    @property
    def gx_dir(self) -> Path:
        """Great Expectations' file data context (stored results, Data Docs)."""
        return self.warehouse

    @property
    def uses_s3(self) -> bool:
        return any(u.startswith("s3://") for u in (self.data_url, self.landing_url))

    def described(self, overrides: dict[str, object] | None = None) -> list[dict[str, str]]:
        """Every setting in effect and where it came from (``featurehouse config``): a command
        line option (``overrides``), the environment variable that set it, or the default; the
        paths derived from them after. A catalog's password is shown as ``***``."""
        given = {k for k, v in (overrides or {}).items() if v is not None}
        rows = []
        for f in fields(self):
            names = _ENV.get(f.name, ())
            set_by = next((n for n in names if _env_str(n)), None)
            source = ("command line" if f.name in given else f"${set_by}" if set_by else "default")
            value = "" if getattr(self, f.name) is None else str(getattr(self, f.name))
            rows.append({"setting": f.name, "value": without_password(value) if f.name == "catalog" else value,
                         "from": source, "variables": ", ".join(f"${n}" for n in names)})
        for name in ("catalog_url", "data_url", "landing_url", "report_dir", "find_index_dir", "gx_dir"):
            value = str(getattr(self, name))
            rows.append({"setting": name, "value": without_password(value) if name == "catalog_url" else value,
                         "from": "derived", "variables": ""})
        return rows

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Resolve settings at call time: explicit overrides, then environment, then defaults."""
        reports = _env_str("FEATUREHOUSE_REPORTS")
        base = cls(
            warehouse=Path(_env_str("FEATUREHOUSE_WAREHOUSE") or DEFAULT_WAREHOUSE),
            catalog=_env_str("FEATUREHOUSE_CATALOG"),
            data_path=_env_str("FEATUREHOUSE_DATA_PATH"),
            landing=_env_str("FEATUREHOUSE_LANDING"),
            retention_days=_env_int("FEATUREHOUSE_RETENTION_DAYS", cls.retention_days),
            max_input_bytes=_env_int("FEATUREHOUSE_MAX_INPUT_BYTES", cls.max_input_bytes),
            max_decompressed_bytes=_env_int(
                "FEATUREHOUSE_MAX_DECOMPRESSED_BYTES", cls.max_decompressed_bytes
            ),
            batch_activations=_env_int("FEATUREHOUSE_BATCH_ACTIVATIONS", cls.batch_activations),
            batch_bytes=_env_int("FEATUREHOUSE_BATCH_BYTES", cls.batch_bytes),
            bytes_per_thread=_env_int("FEATUREHOUSE_BYTES_PER_THREAD", cls.bytes_per_thread),
            input_digest_days=_env_float("FEATUREHOUSE_INPUT_DIGEST_DAYS", cls.input_digest_days),
            reports_dir=Path(reports) if reports else None,
            commit_attempts=_env_int("FEATUREHOUSE_COMMIT_ATTEMPTS", cls.commit_attempts),
            lock_timeout=_env_float("FEATUREHOUSE_LOCK_TIMEOUT", cls.lock_timeout),
            s3_endpoint=_env_str("FEATUREHOUSE_S3_ENDPOINT") or _env_str("AWS_ENDPOINT_URL_S3")
            or _env_str("AWS_ENDPOINT_URL"),
            s3_region=_env_str("AWS_REGION") or _env_str("AWS_DEFAULT_REGION") or cls.s3_region,
            find_dir=Path(find) if (find := _env_str("FEATUREHOUSE_FIND_DIR")) else None,
            data_docs=_env_choice("FEATUREHOUSE_DATA_DOCS", DATA_DOCS, cls.data_docs),
        )
        known = {f.name for f in fields(cls)}
        clean = {k: v for k, v in overrides.items() if v is not None and k in known}
        if "warehouse" in clean:
            clean["warehouse"] = Path(clean["warehouse"])  # type: ignore[arg-type]
        return replace(base, **clean)  # type: ignore[arg-type]


#: The environment variables each setting reads, first first (``Settings.from_env``).
_ENV: dict[str, tuple[str, ...]] = {
    "warehouse": ("FEATUREHOUSE_WAREHOUSE",), "catalog": ("FEATUREHOUSE_CATALOG",),
    "data_path": ("FEATUREHOUSE_DATA_PATH",), "landing": ("FEATUREHOUSE_LANDING",),
    "retention_days": ("FEATUREHOUSE_RETENTION_DAYS",), "max_input_bytes": ("FEATUREHOUSE_MAX_INPUT_BYTES",),
    "max_decompressed_bytes": ("FEATUREHOUSE_MAX_DECOMPRESSED_BYTES",),
    "batch_activations": ("FEATUREHOUSE_BATCH_ACTIVATIONS",), "batch_bytes": ("FEATUREHOUSE_BATCH_BYTES",),
    "bytes_per_thread": ("FEATUREHOUSE_BYTES_PER_THREAD",), "input_digest_days": ("FEATUREHOUSE_INPUT_DIGEST_DAYS",),
    "reports_dir": ("FEATUREHOUSE_REPORTS",), "commit_attempts": ("FEATUREHOUSE_COMMIT_ATTEMPTS",),
    "lock_timeout": ("FEATUREHOUSE_LOCK_TIMEOUT",),
    "s3_endpoint": ("FEATUREHOUSE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "s3_region": ("AWS_REGION", "AWS_DEFAULT_REGION"), "find_dir": ("FEATUREHOUSE_FIND_DIR",),
    "data_docs": ("FEATUREHOUSE_DATA_DOCS",),
}
