"""A run the size of a whole source: past every limit a real one crosses, through the CLI.

Small rows, but more than 5,000 features with both Chat and Non-Chat excerpts in one run (an
Altair chart of one point a feature stops at 5,000 rows), two sources, several export batches of
each kind, explanation files over 1,024 rows each, and several hundred files in one run. Every
output a user reads after such a run works: the summary, the run's report (its charts drawn, the
page small), ``report --run``, ``status``, ``show``, ``history`` and ``changes``.

Also: an ingest under an address-space limit (``ulimit -v``, as batch schedulers set), where the
chart renderer's JavaScript engine cannot start: the load and its report go on, without charts.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from bench.find_source import MODEL, SOURCE, write_source
from bench.generate import write_pages
from tests.conftest import FIXTURES

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")

N_FEATURES = 6144          # explanations: three files of 2,048 rows
N_ACTIVE = 5100            # features with excerpts: five batches of 1,020, one Chat and one Non-Chat excerpt each
N_PAGES = 300              # API pages of another source, in the same run
PAGE_SOURCE = "11-resid-post-aa"


def fh(*args: str, timeout: float = 600, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("source-size")
    gen = write_source(root / "export", N_FEATURES, N_ACTIVE, seed=7, batch=2048, excerpts=2, tokens=8,
                       data_sources=("Chat", "Non-Chat"), activation_batch=1020)
    write_pages(N_PAGES, root / "pages", seed=5)
    wh = root / "wh"
    proc = fh("ingest", str(root / "export"), str(root / "pages"), "--warehouse", str(wh), "--no-progress",
              "--format", "json")
    return wh, gen, proc


def test_the_whole_run_loads(source_run):
    wh, gen, proc = source_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    n_files = 2 * 5 + 3 + N_PAGES  # activations and features batches, explanation files, pages
    assert out["status"] == "succeeded" and out["n_loaded"] == n_files, out
    assert gen["excerpts"] == 2 * N_ACTIVE
    assert out["n_features"] == N_ACTIVE + N_PAGES
    assert out["n_explanations"] >= N_FEATURES
    assert "Traceback" not in proc.stderr and "could not write the report" not in proc.stderr


def test_its_report_is_written_with_every_chart_and_stays_small(source_run):
    wh, _, proc = source_run
    out = json.loads(proc.stdout)
    assert out["report_path"], f"the run wrote no report: {proc.stderr[-2000:]}"
    page = Path(out["report_path"])
    text = page.read_text()
    assert page.stat().st_size < 5 * 1024 * 1024, f"the report is {page.stat().st_size} bytes"
    for chart in ("chart-max-activation", "chart-frac-nonzero", "chart-chat", "chart-top", "chart-trend"):
        figure = re.search(rf'id="{chart}".*?</(figure|div)>', text, re.S)
        assert figure and "<svg" in figure.group(0), f"{chart} is not drawn"
    assert "not drawn" not in text
    # past the points a scatter can hold, the chart counts features per cell, and says so
    assert re.search(r"5,\d{3} features, counted in a 40 × 40 grid", text), "the Chat vs Non-Chat chart does not say it is binned"
    # both sources' statistics
    assert MODEL in text and SOURCE in text and PAGE_SOURCE in text


def test_report_status_show_history_changes_at_that_size(source_run):
    wh, _, proc = source_run
    run_id = json.loads(proc.stdout)["run_id"]
    cmds = [("report", "--run", run_id), ("status",), ("status", "--format", "json"),
            ("show", f"{MODEL}/{SOURCE}/{_an_active_feature(wh)}"), ("history", f"gpt-oss-20b/{PAGE_SOURCE}/3"),
            ("changes", "--since", run_id)]
    for cmd in cmds:
        p = fh(*cmd, "--warehouse", str(wh))
        assert p.returncode == 0, (cmd, p.stderr[-2000:])
        assert "Traceback" not in p.stderr, (cmd, p.stderr[-2000:])
        assert p.stdout.strip(), cmd
    p = fh("changes", "--since", run_id, "--warehouse", str(wh), "--format", "json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)) == N_ACTIVE + N_PAGES + (N_FEATURES - N_ACTIVE)


def _an_active_feature(wh: Path) -> int:
    p = fh("sql", f"SELECT min(feature_index) FROM activations WHERE source_id = '{SOURCE}'", "--warehouse", str(wh),
           "--format", "csv")
    assert p.returncode == 0, p.stderr
    return int(p.stdout.splitlines()[-1])


def _address_space_limit() -> None:  # what `ulimit -v 8000000` sets: 8 GB of virtual memory
    limit = 8_000_000 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS as Linux has it")
def test_an_ingest_under_an_address_space_limit_loads_and_reports_without_charts(tmp_path):
    wh = tmp_path / "wh"
    proc = fh("ingest", str(FIXTURES), "--warehouse", str(wh), "--no-progress", "--format", "json",
              preexec=_address_space_limit)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["status"] == "succeeded" and out["n_loaded"] == 1 and out["n_activations"] == 39
    page = Path(out["report_path"]).read_text()
    note = re.search(r'id="charts-not-drawn">([^<]*)', page)
    if note is None:  # this machine's V8 started under the limit: nothing to prove here
        assert "<svg" in page
        pytest.skip("the chart renderer started under an 8 GB address-space limit on this machine")
    assert "ulimit -v" in note.group(1) and "<svg" not in page
    # one line on stderr, no traceback; the report command under the same limit says the same
    assert "Traceback" not in proc.stderr and proc.stderr.count("charts are not drawn") == 1
    again = fh("report", "--warehouse", str(wh), preexec=_address_space_limit)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    # without the limit, the same report draws its charts
    drawn = fh("report", "--warehouse", str(wh))
    assert drawn.returncode == 0, drawn.stderr
    assert "<svg" in Path(out["report_path"]).read_text()


def test_the_renderer_is_a_child_and_the_ingest_process_never_imports_it(tmp_path):
    """The engine that aborts under the limit never lives in the process that loads."""
    code = ("import sys, json; from pipeline import ingest, Settings; "
            f"s = ingest([{str(FIXTURES)!r}], Settings.from_env(warehouse={str(tmp_path / 'wh')!r}), progress=False); "
            "print(json.dumps({'vl': 'vl_convert' in sys.modules, 'report': s.report_path}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ}).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["report"] and not res["vl"]
    assert "<svg" in Path(res["report"]).read_text()


def test_a_report_that_cannot_be_written_is_one_line_not_a_traceback(source_run, tmp_path):
    wh, _, _ = source_run
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    p = fh("report", "--warehouse", str(wh), "--out", str(blocker / "reports"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("Error: the report could not be written to ") and len(p.stderr.splitlines()) == 1


def test_the_grid_chart_is_drawn_once_and_read_back_after(source_run):
    """Found from outside: the Chat vs Non-Chat grid's cells came in no order, so every report
    drew it again and added a 233 KB file to the chart cache (which keeps 64)."""
    wh, _, _ = source_run
    cache = wh / "reports" / ".charts"
    assert fh("report", "--warehouse", str(wh)).returncode == 0
    before = sorted(p.name for p in cache.glob("*.svg"))
    assert fh("report", "--warehouse", str(wh)).returncode == 0
    assert sorted(p.name for p in cache.glob("*.svg")) == before


def test_a_renderer_killed_by_a_signal_without_a_name_is_said(tmp_path):
    """Found from outside: a real-time signal (kill -40) made the reason itself fail
    ("40 is not a valid Signals")."""
    import signal

    from pipeline.outputs import draw

    drawer = draw._Drawer()
    proc = drawer._spawn()
    try:
        os.kill(proc.pid, signal.SIGRTMIN + 6)
        why = drawer._why_stopped(proc)
    finally:
        drawer._stop()
    assert why.startswith("the chart renderer stopped (signal ") and str(int(signal.SIGRTMIN) + 6) in why


def test_the_renderer_starts_without_being_waited_for_and_answers_the_next_chart(tmp_path):
    """``start`` (the ingest's, while its last batch loads) hands the child the smallest chart
    and goes on; the first real chart reads that answer first and gets its own. A child that
    dies while its engine starts is said by that first chart."""
    import signal

    from pipeline.outputs import draw

    spec = {"data": {"values": [{"x": 1}]}, "mark": "point", "title": "featurehouse-marker",
            "encoding": {"x": {"field": "x", "type": "quantitative"}}}
    drawer = draw._Drawer()
    try:
        drawer.warm()
        assert drawer.unread == 1 and drawer.drawn == 0  # not read yet: nothing waited for it
        drawer.warm()  # started once
        assert drawer.unread == 1
        assert "featurehouse-marker" in drawer.draw(spec) and drawer.unread == 0
        assert "featurehouse-marker" in drawer.draw(spec)
    finally:
        drawer._stop()
    # found by the outside review: one that dies after it answered the warm-up (its engine had
    # started) is started again, as one that had drawn a chart always was
    answered = draw._Drawer()
    try:
        answered.warm()
        import select

        assert select.select([answered.proc.stdout], [], [], 120)[0]  # its answer is there
        os.kill(answered.proc.pid, signal.SIGKILL)
        answered.proc.wait()
        assert "featurehouse-marker" in answered.draw(spec)
    finally:
        answered._stop()
    dying = draw._Drawer()
    try:
        dying.warm()
        os.kill(dying.proc.pid, signal.SIGKILL)
        with pytest.raises(draw.DrawerUnavailable, match="stopped .signal SIGKILL"):
            dying.draw(spec)
        with pytest.raises(draw.DrawerUnavailable):  # said once, not tried again
            dying.warm()
    finally:
        dying._stop()
