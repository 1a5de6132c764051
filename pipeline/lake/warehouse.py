"""The warehouse: a DuckLake (a SQL catalog + Parquet data files), opened with DuckDB.

The catalog is an SQLite file in the warehouse folder by default (several local processes) or
a PostgreSQL database (many machines); the data files live in a folder or an S3 prefix. Every
commit is a snapshot: readers see the last committed one and are never blocked by a load.

This module gathers the names the rest of featurehouse uses (``warehouse.connect``, ...); the
code is in rooms of one concern each, beside it in ``pipeline/lake/``:

- ``catalog.py``: the name the lake is attached under (``CATALOG``), where an SQLite catalog
  file is, and the look that tells a DuckLake from a damaged file (``BadCatalog``);
- ``connect.py``: opening the warehouse (``connect``, ``settings_for``, ``exists``,
  ``WarehouseMissing``, ``LegacyWarehouse``), where its data files are, the S3 secret,
  ``scratch_first``, and ``attach_sql`` for people;
- ``migrations.py``: schema versions and the migrations in ``schemas/migrations``
  (``SchemaTooNew``, ``SchemaTooOld``);
- ``commit.py``: the commit lock (``write_lock``) and transactions (``transaction``,
  ``one_snapshot``, ``is_conflict``, ``CommitStats``, ``CommitFailed``);
- ``sqltext.py``: statements with their values written in (``literal``, ``bind``, ``execute``);
- ``readonly.py``: ad-hoc queries, reads only (``check_read_only``, ``RefusedQuery``), in a
  process that cannot write (``open_for_queries``, ``sandbox``, ``confine_process``);
- ``extensions.py``: the DuckDB extensions, loaded offline from their wheels.

Code in those rooms imports from them, never from here. A test that replaces a function
(monkeypatch) replaces it in its room: replaced here, the room would not see it.
"""

from __future__ import annotations

# ruff: noqa: F401 (every import here is a re-export)
from .catalog import (
    CATALOG,
    BadCatalog,
    _catalog_state,
    _probe_catalog,
    _redact,
    _sqlite_file,
    utcnow,
)
from .commit import (
    _LOCKS,
    CommitFailed,
    CommitStats,
    holds_write_lock,
    is_conflict,
    one_snapshot,
    transaction,
    write_lock,
)
from .connect import (
    LegacyWarehouse,
    WarehouseMissing,
    _attach,
    _data_path_override,
    _open,
    attach_sql,
    connect,
    data_path,
    end_statement,
    exists,
    resolved_data_path,
    scratch_first,
    settings_for,
)
from .extensions import extension_loaded, extension_path, load_extension
from .extensions import new_connection as _duckdb
from .migrations import (
    Migration,
    SchemaTooNew,
    SchemaTooOld,
    apply_migrations,
    latest_version,
    migrations,
    schema_version,
)
from .readonly import (
    READ_ONLY_HELP,
    RefusedQuery,
    _serialized_json,
    check_read_only,
    confine_process,
    open_for_queries,
    sandbox,
)
from .sqltext import _q, bind, execute, literal

__all__ = [
    "CATALOG", "WarehouseMissing", "LegacyWarehouse", "SchemaTooNew", "SchemaTooOld", "CommitFailed", "BadCatalog",
    "connect", "transaction", "write_lock", "holds_write_lock", "schema_version", "migrations", "latest_version",
    "attach_sql", "extension_path", "settings_for", "sandbox", "apply_migrations", "is_conflict", "CommitStats",
    "RefusedQuery", "READ_ONLY_HELP", "check_read_only", "open_for_queries", "confine_process", "data_path",
    "resolved_data_path", "load_extension", "extension_loaded", "exists", "end_statement",
]
