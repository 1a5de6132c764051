"""The Hugging Face dataset card, ``hf/README.md``: YAML ``configs`` naming each table's files,
what each column means (the comments of the migrations' DDL), each table's grain (docs/tables.md),
the counts, the models and sources, the snapshot and the verdicts of the runs that loaded it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import duckdb

from ..config import SCHEMAS_DIR
from ..lake.warehouse import CATALOG
from .publish_snapshot import _columns, _count


def _column_notes() -> dict[str, dict[str, str]]:
    """What each column means, from the comments of the migrations' DDL."""
    notes: dict[str, dict[str, str]] = {}
    table = None
    for path in sorted((SCHEMAS_DIR / "migrations").glob("*.sql")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if m := re.match(r"\s*CREATE TABLE (\w+)", line, re.I):
                table = m.group(1)
            elif re.match(r"\s*\)\s*;", line):
                table = None
            elif m := re.match(r"\s*ALTER TABLE (\w+) ADD COLUMN (?:IF NOT EXISTS )?\"?(\w+)\"?[^-]*--\s*(.+)", line, re.I):
                notes.setdefault(m.group(1), {})[m.group(2)] = m.group(3).strip()
            elif table and (m := re.match(r'\s*"?(\w+)"?\s+[A-Z][^-]*--\s*(.+)', line)):
                notes.setdefault(table, {})[m.group(1)] = m.group(2).strip()
    return notes


def _grains() -> dict[str, str]:
    """Each table's grain, from docs/tables.md where the checkout has it."""
    doc = SCHEMAS_DIR.parent / "docs" / "tables.md"
    out: dict[str, str] = {}
    if doc.is_file():
        for line in doc.read_text(encoding="utf-8").splitlines():
            if m := re.match(r"\|\s*((?:`\w+`(?:,\s*)?)+)\s*\|\s*(.+?)\s*\|\s*$", line):
                for t in re.findall(r"`(\w+)`", m.group(1)):
                    out[t] = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", m.group(2))
    return out


def _runs_verdicts(conn: duckdb.DuckDBPyConnection, snap: int) -> list[dict[str, Any]]:
    from .verdict import verdict

    rows = conn.execute(
        f"SELECT run_id, status, started_at, finished_at, n_received, n_duplicates, n_loaded, n_rejected, "
        f"n_quarantined, n_expectations, n_expectations_failed, n_features, n_activations, n_explanations "
        f"FROM {CATALOG}.main.runs AT (VERSION => {snap}) WHERE n_loaded > 0 ORDER BY started_at").fetchall()
    cols = [d[0] for d in conn.description]
    out = []
    for r in rows:
        run = dict(zip(cols, r))
        v = verdict(run)
        out.append({"run_id": run["run_id"], "started_at": str(run["started_at"]), "verdict": v.level,
                    "why": v.reason, "features": run["n_features"], "quarantined": run["n_quarantined"]})
    return out


def _card(conn: duckdb.DuckDBPyConnection, tables: list[str], snap: int, snap_time: datetime,
          license: str | None, include_private: bool, files: dict[str, list[str]]) -> str:
    import yaml

    notes, grains = _column_notes(), _grains()
    counts = {t: _count(conn, f"{CATALOG}.main.{t} AT (VERSION => {snap})") for t in tables}
    meta = {
        "license": license or "other",
        "pretty_name": "featurehouse: Neuronpedia SAE features",
        "tags": ["interpretability", "sparse-autoencoder", "neuronpedia", "featurehouse"],
        # an empty table has no config: `datasets` refuses a split with no rows ("corresponds to no
        # data"); its file (its columns) is there for pyarrow and DuckDB
        "configs": [{"config_name": t, "data_files": [{"split": "train", "path": f"{t}/*.parquet"}],
                     **({"default": True} if t == "features" else {})} for t in tables if counts[t]],
    }
    models = [r[0] for r in conn.execute(
        f"SELECT DISTINCT model_id FROM {CATALOG}.main.features AT (VERSION => {snap}) ORDER BY 1").fetchall()]
    sources = conn.execute(
        f"SELECT model_id, source_id, count(*) FROM {CATALOG}.main.features AT (VERSION => {snap}) "
        "GROUP BY ALL ORDER BY 1, 2").fetchall()
    runs = _runs_verdicts(conn, snap)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             "# Neuronpedia SAE features, validated and typed (featurehouse)", "",
             "Feature pages of [Neuronpedia](https://www.neuronpedia.org) loaded by "
             "[featurehouse](https://github.com/) into typed tables: every record checked by Great Expectations "
             "suites, bad records quarantined, not loaded.", "",
             f"- **Snapshot**: warehouse snapshot {snap}, {snap_time.isoformat()}",
             f"- **Licence**: {license or 'not given by the publisher (Neuronpedia data: see its terms)'}",
             f"- **Models**: {', '.join(models) or '(none)'}",
             "- **Sources**: " + (", ".join(f"{m}/{s} ({n:,} features)" for m, s, n in sources) or "(none)"),
             "", "## Tables", "", "| config | rows | what one row is |", "|---|---:|---|"]
    lines += [f"| `{t}` | {counts[t]:,}{'' if counts[t] else ' (empty: no config)'} | "
              f"{grains.get(t, '').replace('|', '/')} |" for t in tables]
    for t in tables:
        cols = _columns(conn, t, snap, include_private)
        lines += ["", f"### `{t}`", "", f"Files: {', '.join(f'`{f}`' for f in files.get(t, [])) or '(none)'}", "",
                  "| column | type | meaning |", "|---|---|---|"]
        lines += [f"| `{c}` | `{ty}` | {notes.get(t, {}).get(c, '').replace('|', '/')} |" for c, ty in cols]
    lines += ["", "## Data quality", "", "The runs that loaded this data, with their verdicts (PASS, WARN, FAIL):", "",
              "| run | started | verdict | why |", "|---|---|---|---|"]
    lines += [f"| `{r['run_id']}` | {r['started_at']} | {r['verdict']} | {r['why'].replace('|', '/')} |" for r in runs]
    lines += ["", "## Load", "", "```python", "import datasets", "ds = datasets.load_dataset('ORG/NAME', 'features')",
              "import pandas as pd", "df = pd.read_parquet('hf/features')", "```", ""]
    return "\n".join(lines)
