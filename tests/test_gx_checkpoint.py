"""Great Expectations as its users know it (issue 45): the warehouse's ``gx/`` file data context
holds each table's suite, data asset, batch definition, validation definition and checkpoint;
featurehouse records its results under them; a Great Expectations user re-runs a batch with
Great Expectations' own API (docs/report.md, run here as printed) and gets the failures
featurehouse quarantined."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.outputs.report import write_report
from pipeline.stages import validate
from tests.conftest import FIXTURES, query, run_ingest, write
from tests.test_validate import CASES, GOOD

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "report.md"
KIND = validate.SUITES


def _doc_blocks() -> tuple[str, str]:
    """The two Python blocks of docs/report.md's re-run: featurehouse's frame, then Great
    Expectations alone."""
    text = DOCS.read_text().split("## Great Expectations as its users know it", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2, blocks
    return blocks[0], blocks[1]


@pytest.fixture(scope="module")
def crafted_run(tmp_path_factory):
    """One run of a crafted bad record for every check, and good pages: one batch."""
    root = tmp_path_factory.mktemp("gx_checkpoint")
    paths = [write(root / "in" / f"{name}.json", data) for name, (data, _) in CASES.items()]
    paths += [write(root / "in" / f"zz_good_{i}.json", data) for i, data in enumerate(GOOD)]
    settings = Settings(warehouse=root / "wh")
    summary = run_ingest(paths, settings)
    assert summary.status == "succeeded", summary
    assert query(settings.warehouse, "SELECT count(DISTINCT batch_no) FROM validation_results") == [(1,)]
    # as docs/report.md says: the run's results wait for `featurehouse report`, which has Great
    # Expectations record them (and makes the project's objects, the first time)
    assert not (settings.warehouse / "gx" / "checkpoints").exists()
    write_report(settings, summary.run_id)
    return settings.warehouse, summary.run_id


_GX_ALONE = """
import json, sys
import pandas as pd
frame = pd.read_parquet(sys.argv[1])
{block}
assert not [m for m in sys.modules if m == "pipeline" or m.startswith(("pipeline.", "tests"))], "featurehouse imported"
"""


def _rerun_as_documented(wh: Path, run_id: str, table: str, tmp: Path) -> dict[str, set[str]]:
    """docs/report.md's two blocks for ``table``: the frame here, Great Expectations alone in a
    process of its own. Returns check → the record keys it failed."""
    first, second = _doc_blocks()
    scope: dict = {}
    exec(first.replace('"warehouse"', repr(str(wh))).replace("run-20261205T170404Z-a4a15a", run_id)
         .replace('"activations"', repr(table)), scope)
    frame_file = tmp / f"{table}.parquet"
    scope["frame"].to_parquet(frame_file)
    code = _GX_ALONE.format(block=second.replace('"warehouse"', repr(str(wh)))
                            .replace("featurehouse-activations", f"featurehouse-{table}"))
    done = subprocess.run([sys.executable, "-c", code, str(frame_file)], capture_output=True, text=True,
                          cwd=tmp, timeout=600, env={"GX_ANALYTICS_ENABLED": "False", "PATH": "/usr/bin:/bin",
                                                     "HOME": str(tmp)})
    assert done.returncode == 0, done.stderr[-3000:]
    failed: dict[str, set[str]] = {}
    for line in done.stdout.splitlines():
        check, keys = line.split(" ", 1)
        failed.setdefault(check, set()).update(eval(keys))  # the printed list of keys
    return failed


@pytest.mark.parametrize("table", list(validate.SUITES))
def test_a_great_expectations_user_reruns_a_batch_and_gets_what_was_quarantined(crafted_run, table, tmp_path):
    wh, run_id = crafted_run
    failed = _rerun_as_documented(wh, run_id, table, tmp_path)
    quarantined: dict[str, set[str]] = {}
    for check, key in query(wh, "SELECT check_name, record_key FROM quarantine WHERE run_id = ? AND record_kind = ?",
                            [run_id, KIND[table]]):
        quarantined.setdefault(check, set()).add(key)
    assert quarantined, "the crafted run quarantined nothing of this kind"
    assert failed == quarantined
    # the run is Great Expectations' own: recorded under the checkpoint, its Data Docs page built
    stored = sorted((wh / "gx" / "uncommitted" / "validations" / table / "__none__").rglob("featurehouse-*.json"))
    assert stored
    meta = json.loads(stored[-1].read_text())["meta"]
    ids = json.loads((wh / "gx" / "checkpoints" / f"featurehouse-{table}.json").read_text())
    assert meta["checkpoint_id"] == ids["id"]
    site = wh / "gx" / "uncommitted" / "data_docs" / "local_site"
    assert list((site / "validations" / table / "__none__").rglob("*.html"))
    assert (site / "index.html").exists()


def test_featurehouse_records_its_results_as_the_checkpoint_would(crafted_run):
    """The ingest's results (judged by DuckDB) are stored under the run, each batch's, with the
    ids of the table's validation definition and checkpoint and its data asset in their meta;
    the run's Data Docs pages build from them and the index lists them under their assets."""
    wh, run_id = crafted_run
    gx_dir = wh / "gx"
    for table in validate.SUITES:
        checkpoint = json.loads((gx_dir / "checkpoints" / f"featurehouse-{table}.json").read_text())
        definition = json.loads((gx_dir / "validation_definitions" / f"{table}.json").read_text())
        assert checkpoint["validation_definitions"] == [{"id": definition["id"], "name": table}]
        assert [a["type"] for a in checkpoint["actions"]] == ["update_data_docs"]
        assert definition["suite"]["name"] == table
        assert definition["data"]["asset"]["name"] == table and definition["data"]["datasource"]["name"] == "featurehouse"
        (path,) = (gx_dir / "uncommitted" / "validations" / table / run_id).rglob("batch-0001-*.json")
        meta = json.loads(path.read_text())["meta"]
        assert meta["validation_id"] == definition["id"] and meta["checkpoint_id"] == checkpoint["id"]
        assert meta["active_batch_definition"]["data_asset_name"] == table
        assert meta["run_id"]["run_name"] == run_id
    pages = validate.build_data_docs(wh, run_id)
    assert len(pages) == 3
    index = (gx_dir / "uncommitted" / "data_docs" / "local_site" / "index.html").read_text()
    for table in validate.SUITES:
        assert f"batch-0001-{table}" in index


_SET_UP = """
import json, sys, time
from pipeline.stages import validate
validate._gx()
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all at once
project = validate._file_context(sys.argv[1])
print(json.dumps(project.ids))
"""


def test_two_processes_set_up_one_warehouse_at_once(tmp_path):
    """Processes setting up a new warehouse's context at the same moment all succeed, and find
    the same objects (one of each: no "Store already has the following key")."""
    import time

    start = time.time() + 8  # after the imports (~3 s each, two cores)
    procs = [subprocess.Popen([sys.executable, "-c", _SET_UP, str(tmp_path), str(start)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    ids = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert ids[0] == ids[1] == ids[2]
    assert "already has" not in "".join(e for _, e in outs)
    assert sorted(p.name for p in (tmp_path / "gx" / "checkpoints").glob("*.json")) == \
        [f"featurehouse-{t}.json" for t in sorted(validate.SUITES)]


def test_a_changed_or_missing_object_is_put_right_and_the_rest_kept(tmp_path):
    """A suite edited in the context (or left by an older featurehouse) is brought back to
    schemas/expectations; a checkpoint deleted is made again; what is as wanted keeps its id."""
    import great_expectations as gx

    first = validate._set_up_project(str(tmp_path))
    context = gx.get_context(mode="file", project_root_dir=tmp_path)
    suite = context.suites.get("features")
    suite.delete_expectation(suite.expectations[0])
    context.checkpoints.delete("featurehouse-explanations")
    again = validate._set_up_project(str(tmp_path))
    assert again.ids["features"] == first.ids["features"]
    assert again.ids["activations"] == first.ids["activations"]
    assert again.ids["explanations"][0] == first.ids["explanations"][0]  # its validation definition
    assert again.ids["explanations"][1] != first.ids["explanations"][1]  # a new checkpoint
    suite = gx.get_context(mode="file", project_root_dir=tmp_path).suites.get("features")
    assert validate._shape(suite) == validate._shape(gx.ExpectationSuite(
        name="features", expectations=validate.load_suite("features")["expectations"]))


def test_great_expectations_runs_unpatched(tmp_path, monkeypatch):
    """Nothing of Great Expectations is replaced: ``Expectation.configuration`` is its own
    property, before and after featurehouse validates with it."""
    from great_expectations.expectations.expectation import Expectation

    monkeypatch.setattr(validate, "JUDGE", "gx")
    summary = run_ingest([FIXTURES], Settings(warehouse=tmp_path / "wh"))
    assert summary.status == "succeeded" and summary.n_quarantined == 1
    prop = Expectation.__dict__["configuration"]
    assert isinstance(prop, property) and prop.fget.__module__ == "great_expectations.expectations.expectation"
    assert not [n for n in dir(validate) if "memo" in n.lower()]


def test_frame_for_refuses_what_it_cannot_give(crafted_run):
    wh, run_id = crafted_run
    with pytest.raises(ValueError, match="no suite judges"):
        validate.frame_for("models", wh, run_id=run_id)
    with pytest.raises(ValueError, match="not both"):
        validate.frame_for("features", wh)
    with pytest.raises(ValueError, match="landed no input"):
        validate.frame_for("features", wh, inputs=["0" * 64])
    frame = validate.frame_for("features", wh, inputs=[sha for (sha,) in query(
        wh, "SELECT input_sha256 FROM quarantine WHERE check_name = 'frac_nonzero_is_fraction'")])
    assert len(frame) == 1 and frame["frac_nonzero"].iloc[0] == 1.5
