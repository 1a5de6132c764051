"""What an unchanged re-run or a small run does not redo (issue 10): no Great Expectations when
nothing is validated, charts drawn once per content, results stored beside the load."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import date, datetime, timezone
from pathlib import Path

import duckdb
import pytest

from pipeline import Settings, ingest
from pipeline.lake import warehouse
from pipeline.outputs.report import write_report

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(autouse=True)
def _data_docs_with_the_run(monkeypatch):
    """What these tests hold is the cost of ``data_docs = "run"`` (Great Expectations records
    and builds a run's Data Docs in its ingest), which the default (``report``) leaves to
    ``featurehouse report``: tests/test_data_docs_later.py holds that one."""
    monkeypatch.setenv("FEATUREHOUSE_DATA_DOCS", "run")


def _settings(tmp: Path) -> Settings:
    return Settings.from_env(warehouse=tmp / "wh")


_CHILD = """
import json, sys
from pipeline import Settings
from pipeline import ingest
s = ingest([sys.argv[1]], Settings.from_env(warehouse=sys.argv[2]), progress=False)
print(json.dumps({"gx": "great_expectations" in sys.modules, "loaded": s.n_loaded,
                  "drew": "pipeline.outputs.draw" in sys.modules and sys.modules["pipeline.outputs.draw"].drew_any(),
                  "pandas": "pandas" in sys.modules,
                  "report": s.report_path, "status": s.status}))
"""


def _ingest_child(inputs: Path, wh: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(inputs), str(wh)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_an_unchanged_rerun_does_not_import_great_expectations(tmp_path):
    wh = tmp_path / "wh"
    first = _ingest_child(FIXTURES, wh)
    assert first["gx"] and first["loaded"] == 1  # it validated the seed page
    again = _ingest_child(FIXTURES, wh)
    assert again["status"] == "succeeded" and again["loaded"] == 0
    assert not again["gx"], "a re-run with nothing to validate imported Great Expectations (seconds)"
    # nor pandas (0.3-0.45 s), which DuckDB's client imports to bind any parameter, pyarrow's pa.array too
    assert not again["pandas"], "a re-run that loads nothing imported pandas: a statement bound a parameter"
    page = Path(again["report"]).read_text()
    assert '<div class="verdict PASS"' in page
    # the short form: nothing drawn (V8's start alone is ~0.4 s), the statistics are the first run's
    assert not again["drew"] and "<svg" not in page
    assert f'<a href="{Path(first["report"]).name}" id="last-loaded">' in page
    assert page.count('class="trend-run') == 2


def test_a_run_that_changed_something_draws_its_charts(tmp_path):
    """The short form is only for a run that changed nothing: a new page draws the charts."""
    wh = tmp_path / "wh"
    _ingest_child(FIXTURES, wh)
    from bench.generate import write_pages

    write_pages(1, tmp_path / "more", start=321)
    run = _ingest_child(tmp_path / "more", wh)
    assert run["loaded"] == 1 and run["drew"]
    page = Path(run["report"]).read_text()
    assert 'id="unchanged"' not in page and page.count("<svg") >= 4


def test_a_run_of_refused_inputs_only_does_not_import_great_expectations(tmp_path):
    """Inputs refused before staging (not a page, not JSON) leave no record to validate."""
    inbox = tmp_path / "in"
    inbox.mkdir()
    (inbox / "notes.txt").write_text("not a feature page at all\n")
    (inbox / "cut.json").write_text('{"modelId": "gpt2-small", "layer": ')
    run = _ingest_child(inbox, tmp_path / "wh")
    assert run["status"] == "succeeded" and run["loaded"] == 0
    assert not run["gx"], "a run with no record to validate imported Great Expectations (seconds)"
    assert '<div class="verdict FAIL"' in Path(run["report"]).read_text()


def test_a_refused_single_line_page_runs_clean(tmp_path):
    """A one-line JSON input goes to DuckDB's road, so its refusal is known only after the
    import of Great Expectations has started in a thread. With no record judged, nothing is
    stored and the run waits for that import before going on. (A first version of skipping
    Great Expectations for such batches stored "nothing" by importing its modules in a second
    thread beside that import: Python's import locks deadlocked, with a traceback and "could
    not store Great Expectations results" in every such run.)"""
    inbox = tmp_path / "in"
    inbox.mkdir()
    (inbox / "error.json").write_text('{"error": "Not found"}')
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(inbox), str(tmp_path / "wh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "could not store" not in proc.stderr, proc.stderr
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["status"] == "succeeded" and run["loaded"] == 0


def _svgs(page: str) -> list[str]:
    # the ids are made unique per page: compare without them
    return [re.sub(r'c\d+-', "", s) for s in re.findall(r"<svg .*?</svg>", page, flags=re.S)]


def test_a_chart_drawn_before_is_read_back_not_drawn_again(tmp_path):
    settings = _settings(tmp_path)
    summary = ingest([FIXTURES], settings, progress=False)
    cache = settings.report_dir / ".charts"
    drawn = sorted(cache.glob("*.svg"))
    first = _svgs(Path(summary.report_path).read_text())
    assert len(drawn) >= 4 and len(first) >= 4
    again = write_report(settings, summary.run_id)
    assert sorted(cache.glob("*.svg")) == drawn  # nothing new was drawn
    assert _svgs(again.read_text()) == first  # and what was read back is what was drawn
    for p in drawn:  # the cache is what the report shows: mark every entry
        p.write_text(p.read_text().replace("<svg ", '<svg data-from-cache="yes" ', 1))
    marked = write_report(settings, summary.run_id).read_text()
    assert marked.count('data-from-cache="yes"') == len(first)


def test_new_data_draws_new_charts(tmp_path):
    settings = _settings(tmp_path)
    ingest([FIXTURES], settings, progress=False)
    cache = settings.report_dir / ".charts"
    before = {p.name for p in cache.glob("*.svg")}
    from bench.generate import write_pages

    write_pages(3, tmp_path / "more", start=500)
    summary = ingest([tmp_path / "more"], settings, progress=False)
    assert summary.n_loaded == 3
    new = {p.name for p in cache.glob("*.svg")} - before
    assert len(new) >= 4, "charts of changed data were read back from the cache"


def test_an_unwritable_chart_cache_does_not_stop_the_report(tmp_path):
    settings = _settings(tmp_path)
    settings.report_dir.mkdir(parents=True)
    (settings.report_dir / ".charts").write_text("not a folder")
    summary = ingest([FIXTURES], settings, progress=False)
    assert summary.report_path and Path(summary.report_path).read_text().count("<svg") >= 4


def test_results_of_every_batch_are_stored_for_data_docs(tmp_path, monkeypatch):
    """Results are stored in a thread beside the load: every batch's reach the Data Docs."""
    monkeypatch.setenv("FEATUREHOUSE_BATCH_ACTIVATIONS", "30")  # a batch per page
    from bench.generate import write_pages

    write_pages(4, tmp_path / "pages", start=900)
    settings = _settings(tmp_path)
    summary = ingest([tmp_path / "pages"], settings, progress=False)
    assert summary.n_loaded == 4
    page = Path(summary.report_path).read_text()
    batches = set(re.findall(r"batch-(\d{4})-activations", page))
    assert batches == {"0001", "0002", "0003", "0004"}
    stored = settings.gx_dir / "gx" / "uncommitted" / "validations" / "activations" / summary.run_id
    assert len(list(stored.rglob("*.json"))) == 4


def _charts(page: str) -> tuple[int, int]:
    return len(re.findall(r"<svg ", page)), len(re.findall(r"</svg>", page))


@pytest.mark.parametrize("damage", ["emptied", "truncated"])
def test_a_damaged_cached_chart_is_drawn_again(tmp_path, damage):
    """Found by the outside review: a cut-short cache entry was shown as it was (an unclosed
    <svg> swallowed the rest of the page), and kept for ever (reading it refreshed its age)."""
    settings = _settings(tmp_path)
    summary = ingest([FIXTURES], settings, progress=False)
    first = _charts(Path(summary.report_path).read_text())
    assert first[0] == first[1] >= 4
    entries = list((settings.report_dir / ".charts").glob("*.svg"))
    for p in entries:
        text = p.read_text()
        p.write_text("" if damage == "emptied" else text[: len(text) // 2])  # e.g. a crash, a full disk
    again = write_report(settings, summary.run_id).read_text()
    assert _charts(again) == first  # every chart is there, and whole
    assert again.rstrip().endswith("</html>")
    assert all(p.read_text().rstrip().endswith("</svg>") for p in entries)  # and the entries mended


def test_data_docs_pages_are_built_with_their_batch_and_not_again(tmp_path, monkeypatch):
    """Each batch's Data Docs pages are built as its results are stored (in the thread beside
    the load); the report builds the site's index and only pages still missing."""
    monkeypatch.setenv("FEATUREHOUSE_BATCH_ACTIVATIONS", "30")  # a batch per page
    from bench.generate import write_pages

    write_pages(2, tmp_path / "pages", start=940)
    settings = _settings(tmp_path)
    summary = ingest([tmp_path / "pages"], settings, progress=False)
    site = settings.gx_dir / "gx" / "uncommitted" / "data_docs" / "local_site"
    pages = sorted((site / "validations").rglob(f"*/{summary.run_id}/*/batch-*.html"))
    assert len(pages) == 6  # 3 suites x 2 batches
    for p in pages:
        p.write_text(p.read_text() + "<!-- built once -->")
    index = site / "index.html"
    index.write_text("stale")
    page = write_report(settings, summary.run_id).read_text()
    assert all(p.read_text().endswith("<!-- built once -->") for p in pages)  # not built again
    assert index.read_text() != "stale" and summary.run_id in index.read_text()  # the index is
    assert len(re.findall(r"batch-\d{4}-activations", page)) >= 2
    pages[0].unlink()  # a page gone (or stored by an older release) is built by the report
    write_report(settings, summary.run_id)
    assert pages[0].exists()


def test_a_runs_own_report_leaves_the_data_docs_index_to_the_report_command(tmp_path):
    """Great Expectations rebuilds the Data Docs index from every result ever stored (~5 ms
    each): the report ``ingest`` writes builds and links the run's own pages and leaves an
    existing index as it is, so its cost does not grow with every run; ``write_report`` (the
    ``featurehouse report`` command, the nightly report task) refreshes it."""
    from bench.generate import write_pages

    settings = _settings(tmp_path)
    write_pages(1, tmp_path / "a", start=960)
    first = ingest([tmp_path / "a"], settings, progress=False)
    index = settings.gx_dir / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    built = index.read_text()  # the first run built it: the site had none
    assert first.run_id in built
    write_pages(1, tmp_path / "b", start=961)
    second = ingest([tmp_path / "b"], settings, progress=False)
    page = Path(second.report_path).read_text()
    assert len(re.findall(r'href="[^"]*/' + re.escape(second.run_id) + r'/[^"]*batch-0001-\w+\.html"', page)) == 3
    assert index.read_text() == built  # not rebuilt, and the report says so beside the link
    assert "its index lists this run once <code>featurehouse report</code>" in page
    refreshed = write_report(settings, second.run_id).read_text()
    assert second.run_id in index.read_text()
    assert "its index lists this run once" not in refreshed


_HOSTILE = ["it's", "a?b", "$x", "-- not a comment", "/* nor this */", "line\nbreak", "ünïcødé 漢字",
            "back\\slash", "''", '"quoted"', "", "?", "$$", 0, -2**62, 2**62, 1.5, -0.0, float("inf"),
            float("-inf"), True, False, None, datetime(2026, 12, 2, 1, 2, 3, 456789),
            datetime(2026, 12, 2, 1, 2, 3, tzinfo=timezone.utc), date(2026, 1, 31), ["a'b", "?", "$x"], [1, 2], []]


@pytest.mark.parametrize("value", _HOSTILE, ids=lambda v: repr(v)[:24])
def test_values_written_into_sql_read_as_duckdb_binds_them(value):
    """The run that loads nothing writes its values into its SQL (warehouse.bind) instead of
    binding them: each value reads back exactly as DuckDB's own binding gives it, with the
    placeholders' marks inside quoted strings, quoted names and comments left alone."""
    conn = duckdb.connect()
    sql = """SELECT ? AS v, '?' AS q, '$x' AS d, "$x" AS i, typeof(?) AS t
             FROM (SELECT 1 AS "$x") -- ? $x in a comment
             WHERE ? IS NOT DISTINCT FROM ? /* ? */"""
    written = conn.execute(warehouse.bind(sql, [value] * 4)).fetchall()
    bound = conn.execute(sql, [value] * 4).fetchall()
    assert written == bound
    named = conn.execute(warehouse.bind("SELECT $v = $v, '$v'", {"v": value})).fetchall()
    assert named == conn.execute("SELECT $v = $v, '$v'", {"v": value}).fetchall()


def test_writing_values_into_sql_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="fewer values"):
        warehouse.bind("SELECT ?, ?", [1])
    with pytest.raises(ValueError, match="more values"):
        warehouse.bind("SELECT ?", [1, 2])
    with pytest.raises(KeyError):
        warehouse.bind("SELECT $a, $b", {"a": 1})
    with pytest.raises(ValueError, match="NUL"):
        warehouse.literal("a\0b")
    with pytest.raises(TypeError):
        warehouse.literal(object())


@pytest.mark.parametrize("value", [-1, -2**62, -2.5, -0.0, 3, 1.25])
def test_a_negative_value_written_after_a_minus_is_not_a_comment(value):
    """Found by the outside review: 10-$x with x = -1 was written 10--1, a comment."""
    conn = duckdb.connect()
    assert conn.execute(warehouse.bind("SELECT 10-?, [?] WHERE 1 = 1", [value, value])).fetchall() == \
        conn.execute("SELECT 10-?, [?] WHERE 1 = 1", [value, value]).fetchall()
    assert conn.execute(warehouse.bind("SELECT 10-$n WHERE 1 = 1", {"n": value})).fetchall() == \
        conn.execute("SELECT 10-$n WHERE 1 = 1", {"n": value}).fetchall()


def test_heavy_imports_in_two_threads_leave_the_collector_on():
    """Found by the outside review: two threads' blocks overlapping (A in, B in, A out, B out)
    left the collector off for good. It stays paused until the last block ends."""
    import gc
    import threading

    from pipeline.stages.validate import heavy_imports

    assert gc.isenabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with heavy_imports():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with heavy_imports():
            b_in.set()
            a_out.wait(5)
            seen["paused after A left"] = not gc.isenabled()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert seen == {"paused after A left": True}
    assert gc.isenabled()
    gc.disable()  # a collector the caller switched off stays off
    try:
        with heavy_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_report_written_inside_a_callers_transaction_leaves_it_and_its_temp_tables(tmp_path):
    """Found by the outside review: write_report(conn) inside a transaction the caller opened
    raised and rolled the caller's work back; and a caller's temp table named as one of the
    report's own was replaced, then dropped."""
    settings = _settings(tmp_path)
    ingest([FIXTURES], settings, progress=False)
    with warehouse.connect(settings) as conn:
        conn.execute("CREATE TEMP TABLE mine AS SELECT 1 AS x")
        conn.execute("CREATE TEMP TABLE report_stats AS SELECT 'the caller''s' AS v")
        conn.execute("BEGIN TRANSACTION")
        conn.execute("INSERT INTO mine VALUES (2)")
        write_report(conn, None, out_dir=tmp_path / "out", settings=settings)
        conn.execute("INSERT INTO mine VALUES (3)")
        conn.execute("COMMIT")
        assert conn.execute("SELECT count(*) FROM mine").fetchone() == (3,)
        assert conn.execute("SELECT v FROM report_stats").fetchall() == [("the caller's",)]
        assert not conn.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE '_report_%'").fetchone()[0]


def test_the_chart_drawer_starts_while_the_last_batch_loads_and_its_failure_fails_nothing(tmp_path, monkeypatch):
    """ingest starts vl-convert's engine in the main thread while the loader thread writes the
    last batch (~0.4 s off the report at the end); if that fails, the run and its report do not."""
    from pipeline.outputs import report

    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("no JavaScript engine here")

    monkeypatch.setattr(report, "warm_charts", broken)
    s = ingest([FIXTURES], _settings(tmp_path), progress=False)
    assert calls == [1], "the drawer was not started while the last batch loaded"
    assert s.status == "succeeded" and s.n_loaded == 1
    page = Path(s.report_path).read_text()
    assert page.count("<svg") >= 2, "the report drew no charts"


def test_the_report_is_prepared_while_the_last_batch_writes_its_files(tmp_path, monkeypatch):
    """vl-convert holds the GIL while it draws: ingest starts the chart drawer only once the
    loader thread is inside the write of the last batch's files (a statement without the GIL),
    not while the loader runs the small statements before it; the run's Data Docs pages are
    built there too, so the report at the end finds them built."""
    import importlib

    from pipeline.outputs import report
    from pipeline.stages import validate

    loading_mod = importlib.import_module("pipeline.ingest.loading")  # where the loader looks prewrite up
    events: list[str] = []
    real_prewrite, real_docs = loading_mod.prewrite, validate.build_data_docs

    def prewrite(*args, on_write=None, **kwargs):
        def noted():
            events.append("write begins")
            if on_write is not None:
                on_write()
        return real_prewrite(*args, on_write=noted, **kwargs)

    def docs(*args, **kwargs):
        events.append("data docs")
        return real_docs(*args, **kwargs)

    monkeypatch.setattr(loading_mod, "prewrite", prewrite)
    monkeypatch.setattr(report, "warm_charts", lambda: events.append("charts"))
    monkeypatch.setattr(validate, "build_data_docs", docs)
    s = ingest([FIXTURES], _settings(tmp_path), progress=False)
    assert s.status == "succeeded"
    assert events[:3] == ["write begins", "charts", "data docs"], events
    page = Path(s.report_path).read_text()
    assert "validations/" in page, "the report does not link the run's Data Docs pages"
