"""Run-time settings: one typed class, resolved from the environment, then defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

SCHEMAS_DIR = Path(os.environ.get("FEATUREHOUSE_SCHEMAS", Path(__file__).resolve().parent.parent / "schemas"))
DEFAULT_WAREHOUSE = Path("warehouse") / "featurehouse.duckdb"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer number of bytes or items, got {raw!r}") from exc


@dataclass(frozen=True)
class Settings:
    """Where the warehouse lives and the limits an ingest run enforces."""

    warehouse: Path = field(default=DEFAULT_WAREHOUSE)
    """DuckDB file; `$FEATUREHOUSE_WAREHOUSE`, else ./warehouse/featurehouse.duckdb."""

    max_input_bytes: int = 256 * 1024 * 1024
    """Largest input accepted for parsing, as received; `$FEATUREHOUSE_MAX_INPUT_BYTES`."""

    max_decompressed_bytes: int = 1024 * 1024 * 1024
    """Largest size a gzip input may expand to; past it the input is refused
    (guards against gzip bombs); `$FEATUREHOUSE_MAX_DECOMPRESSED_BYTES`."""

    batch_activations: int = 20_000
    """Activations gathered before a batch is validated and loaded (bounds memory);
    `$FEATUREHOUSE_BATCH_ACTIVATIONS`."""

    batch_bytes: int = 64 * 1024 * 1024
    """Input bytes gathered before a batch is validated and loaded (bounds memory);
    `$FEATUREHOUSE_BATCH_BYTES`."""

    reports_dir: Path | None = None
    """Where HTML reports go; default `reports/` beside the warehouse."""

    @property
    def landing_dir(self) -> Path:
        """Content-addressed store of every input, beside the warehouse."""
        return self.warehouse.parent / "landing"

    @property
    def report_dir(self) -> Path:
        return self.reports_dir if self.reports_dir is not None else self.warehouse.parent / "reports"

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Resolve settings at call time: explicit overrides, then environment, then defaults."""
        base = cls(
            warehouse=Path(os.environ.get("FEATUREHOUSE_WAREHOUSE") or DEFAULT_WAREHOUSE),
            max_input_bytes=_env_int("FEATUREHOUSE_MAX_INPUT_BYTES", cls.max_input_bytes),
            max_decompressed_bytes=_env_int(
                "FEATUREHOUSE_MAX_DECOMPRESSED_BYTES", cls.max_decompressed_bytes
            ),
            batch_activations=_env_int("FEATUREHOUSE_BATCH_ACTIVATIONS", cls.batch_activations),
            batch_bytes=_env_int("FEATUREHOUSE_BATCH_BYTES", cls.batch_bytes),
            reports_dir=Path(os.environ["FEATUREHOUSE_REPORTS"]) if os.environ.get("FEATUREHOUSE_REPORTS") else None,
        )
        known = {f.name for f in fields(cls)}
        clean = {k: v for k, v in overrides.items() if v is not None and k in known}
        if "warehouse" in clean:
            clean["warehouse"] = Path(clean["warehouse"])  # type: ignore[arg-type]
        return replace(base, **clean)  # type: ignore[arg-type]
