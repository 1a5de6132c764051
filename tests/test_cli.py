"""The ``featurehouse`` console script, run as a user runs it (a subprocess)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from pipeline.cli import cli
from tests.conftest import FIXTURES, query

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def fh(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    wh = tmp_path_factory.mktemp("cli") / "wh"
    return wh, fh("ingest", str(FIXTURES), "--warehouse", str(wh), "--no-progress")


def test_ingest_prints_a_summary_and_exits_0(warehouse):
    wh, proc = warehouse
    assert proc.returncode == 0, proc.stderr
    assert "loaded 1, rejected 1" in proc.stdout
    assert "activations 39" in proc.stdout and "quarantined 1" in proc.stdout
    assert "002_cdcf7f83dd4b10f8.txt" in proc.stdout and "not a Neuronpedia feature page" in proc.stdout


def test_sql_csv(warehouse):
    wh, _ = warehouse
    proc = fh("sql", "SELECT data_source, n_examples FROM feature_activation_stats ORDER BY 1",
              "--warehouse", str(wh), "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert list(csv.reader(io.StringIO(proc.stdout))) == [["data_source", "n_examples"], ["Chat", "19"], ["Non-Chat", "20"]]


def test_sql_json(warehouse):
    wh, _ = warehouse
    proc = fh("sql", "SELECT feature_index, source_id, created_at FROM features", "--warehouse", str(wh), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["feature_index"] == 45698 and row["source_id"] == "11-resid-post-aa"
    assert row["created_at"].startswith("2025-09-24")


def test_sql_json_keeps_every_column_when_names_repeat(warehouse):
    """SELECT 1 AS a, 2 AS a gave {"a": 2}; a join's two ``extra`` columns became one. Names are
    made unique as DuckDB makes a subquery's."""
    wh, _ = warehouse
    proc = fh("sql", "SELECT 1 AS a, 2 AS a, 3 AS a_1", "--warehouse", str(wh), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"a": 1, "a_1": 2, "a_1_1": 3}]
    proc = fh("sql", "SELECT f.extra, a.extra FROM features f JOIN activations a USING (model_id, source_id, feature_index) "
              "LIMIT 1", "--warehouse", str(wh), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert list(json.loads(proc.stdout)[0]) == ["extra", "extra_1"]


def test_a_mistyped_table_is_named_with_the_nearest_and_booleans_are_csv_booleans(warehouse):
    """Issue 45: a mistyped table got ~900 characters of read-only rules and no "did you mean";
    --format csv wrote Python's True/False."""
    wh, _ = warehouse
    proc = fh("sql", "SELECT * FROM feature", "--warehouse", str(wh))
    assert proc.returncode == 1 and "did you mean features?" in proc.stderr and len(proc.stderr) < 250, proc.stderr
    proc = fh("sql", "SELECT true AS t, false AS f, NULL::BOOLEAN AS n", "--warehouse", str(wh), "--format", "csv")
    assert proc.stdout.splitlines() == ["t,f,n", "true,false,"]
    assert fh("--version").stdout.startswith("featurehouse, version ")


def test_the_version_is_past_the_last_release_the_changelog_names():
    """Issue 45 review: `--version` said 0.1.0, the release the README calls the old single-file
    warehouse (`migrate` moves "a 0.1 warehouse" over), so a user could not tell them apart."""
    from packaging.version import Version

    released = re.findall(r"^## (\d+\.\d+\.\d+) ", (ROOT / "CHANGELOG.md").read_text(), re.M)
    unreleased = "## Unreleased" in (ROOT / "CHANGELOG.md").read_text()
    shown = Version(fh("--version").stdout.split("version ")[1].strip())
    assert released and shown > Version(released[0]) if unreleased else shown == Version(released[0]), (shown, released)
    import pipeline  # what reports, publications and the catalog record is the same version

    assert Version(pipeline.__version__) == shown


def test_sql_table_is_the_default(warehouse):
    wh, _ = warehouse
    proc = fh("sql", "SELECT count(*) AS n_activations FROM activations", "--warehouse", str(wh))
    assert proc.returncode == 0, proc.stderr
    assert "n_activations" in proc.stdout and re.search(r"\b39\b", proc.stdout)


@pytest.mark.parametrize("statement", ["DELETE FROM activations", "CREATE TABLE x (a INT)",
                                       "UPDATE features SET max_act_approx = 0"])
def test_sql_is_read_only(warehouse, statement):
    wh, _ = warehouse
    proc = fh("sql", statement, "--warehouse", str(wh))
    assert proc.returncode != 0
    assert "read-only" in (proc.stderr + proc.stdout).lower()
    assert query(wh, "SELECT count(*), min(max_act_approx) FROM activations, features") == [(39, 366.75)]


def test_sql_without_a_warehouse_says_what_to_do(tmp_path):
    proc = fh("sql", "SELECT 1", "--warehouse", str(tmp_path / "none.duckdb"))
    assert proc.returncode != 0 and "featurehouse ingest" in proc.stderr
    assert not (tmp_path / "none.duckdb").exists()


def test_status(warehouse):
    wh, _ = warehouse
    proc = fh("status", "--warehouse", str(wh))
    assert proc.returncode == 0, proc.stderr
    (run_id,) = query(wh, "SELECT run_id FROM runs")[0]
    assert run_id in proc.stdout and "succeeded" in proc.stdout
    assert "holds 1 features, 39 activations, 1 explanations;\n                1 quarantined records, 1 rejected inputs\n" \
        in proc.stdout
    assert max(len(line) for line in proc.stdout.split("warehouse holds")[1].splitlines()) <= 80


def test_warehouse_from_the_environment_and_reprocess(tmp_path):
    env = {"FEATUREHOUSE_WAREHOUSE": str(tmp_path / "env" / "w.duckdb")}
    seed = str(FIXTURES / "000_e9e35889d0228029.txt")
    first = fh("ingest", seed, "--no-progress", env=env)
    assert first.returncode == 0 and "received 1 = new 1 + read again 0 + already landed 0" in first.stdout
    re_run = fh("ingest", seed, "--no-progress", "--reprocess", env=env)
    assert re_run.returncode == 0 and "received 1 = new 0 + read again 1 + already landed 0" in re_run.stdout
    assert "loaded 1, rejected 0, skipped 0" in re_run.stdout
    assert query(tmp_path / "env" / "w.duckdb", "SELECT count(*) FROM activations") == [(39,)]
    assert fh("status", env=env).stdout.count("succeeded") == 2


def test_missing_path_is_a_usage_error(tmp_path):
    proc = fh("ingest", str(tmp_path / "nope"), "--warehouse", str(tmp_path / "w.duckdb"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_a_run_that_cannot_write_its_warehouse_exits_non_zero(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = fh("ingest", str(FIXTURES), "--warehouse", str(blocker / "w.duckdb"), "--no-progress")
    assert proc.returncode != 0


def _commands(group: click.Group, prefix: str = "featurehouse") -> list[str]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append(f"{prefix} {name}")
        if isinstance(cmd, click.Group):
            out.extend(_commands(cmd, f"{prefix} {name}"))
    return out


@pytest.mark.parametrize("command", _commands(cli))
def test_every_command_is_documented_in_the_readme(command):
    assert command in README.read_text(), f"README.md does not mention `{command}`"


# --- for scripts: --strict and --format json ------------------------------------------------


@pytest.mark.heavy(40)
def test_ingest_strict_exits_4_on_fail_and_json_is_all_stdout_holds(tmp_path):
    wh = str(tmp_path / "wh")
    fail = tmp_path / "fail"  # new inputs, none loaded: FAIL
    fail.mkdir()
    (fail / "error.json").write_text('{"error": "Not found"}')
    r = fh("ingest", str(fail), "--warehouse", wh, "--no-progress", "--strict", "--format", "json")
    assert r.returncode == 4, r.stderr
    out = json.loads(r.stdout)
    assert (out["verdict"], out["status"], out["n_received"], out["n_rejected"]) == ("FAIL", "succeeded", 1, 1)
    assert "none loaded" in out["verdict_reason"] and Path(out["report_path"]).is_file()

    # without --strict a FAIL run still exits 0, and says its verdict
    (fail / "error.json").write_text('{"error": "Gone"}')
    r = fh("ingest", str(fail), "--warehouse", wh, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "verdict  FAIL: 1 input(s) not already landed received, none loaded" in r.stdout

    # a PASS run exits 0 under --strict; its progress bar (over 20 inputs) goes to stderr
    from bench.generate import write_pages

    write_pages(21, tmp_path / "pass", valid=True)
    r = fh("ingest", str(tmp_path / "pass"), "--warehouse", wh, "--strict", "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["verdict"], out["n_loaded"], out["n_quarantined"]) == ("PASS", 21, 0)
    assert "ingest" in r.stderr  # the progress bar

    r = fh("status", "--warehouse", wh, "--format", "json")
    assert r.returncode == 0, r.stderr
    runs = json.loads(r.stdout)
    assert [(x["run_id"], x["status"], x["verdict"]) for x in runs] == [
        (out["run_id"], "succeeded", "PASS"), (runs[1]["run_id"], "succeeded", "FAIL"),
        (runs[2]["run_id"], "succeeded", "FAIL")]
    assert runs[0]["n_loaded"] == 21 and runs[0]["started_at"] < runs[0]["finished_at"]


def test_ingest_help_documents_exit_codes():
    from click.testing import CliRunner

    text = CliRunner().invoke(cli, ["ingest", "--help"]).output
    assert "--strict" in text and "--format [table|json]" in text
    assert "Exit codes:" in text and "4  --strict and the run's verdict is FAIL" in text


def test_the_sigterm_handler_does_not_raise_inside_an_import_and_sends_the_signal_again(tmp_path, monkeypatch):
    """Found from outside: a SIGTERM half a second into `featurehouse ingest` raised inside an
    import and left the interpreter's import lock held; the run hung. Inside an import the
    handler raises nothing and sends the signal again once the import is done; outside one it
    raises as before."""
    import importlib
    import signal
    import threading

    from pipeline import cli as cli_module

    again = threading.Event()
    before = signal.signal(signal.SIGTERM, lambda signum, frame: again.set())
    (tmp_path / "fh_terminated_during_import.py").write_text(
        "import sys\n"
        "from pipeline.cli import _terminated\n"
        "_terminated(15, sys._getframe())  # returns: this is an import\n"
        "finished = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert importlib.import_module("fh_terminated_during_import").finished
        assert again.wait(5), "the signal was not sent again"
        with pytest.raises(cli_module.Terminated):
            cli_module._terminated(signal.SIGTERM, sys._getframe())
    finally:
        signal.signal(signal.SIGTERM, before)
        sys.modules.pop("fh_terminated_during_import", None)
        cli_module._TERMINATED.clear()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("delay", [0.3, 0.6, 1.0, 2.0])
def test_a_signal_at_any_moment_of_an_ingest_says_what_happened(tmp_path, delay, sig):
    """Issue 41 item 7: a SIGTERM in the first second (the command's imports, opening the
    warehouse) ended the process with no word and no run row (rc -15); a Ctrl-C then hung the
    process for good (Python's KeyboardInterrupt raised inside an import left the import lock
    held: the Great Expectations import thread waited on it, the main thread on that thread).
    Now, whenever either comes once the command's module is loading: exit 143 or 130 and one
    line that says what was loaded."""
    import signal
    import time

    signum = getattr(signal, sig)
    wh = tmp_path / "wh"
    # a shell's background job ignores SIGINT, and Python keeps an inherited "ignore"
    proc = subprocess.Popen([str(FEATUREHOUSE), "ingest", str(FIXTURES), "--warehouse", str(wh), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the ingest hung after {sig} at {delay} s")
    if proc.returncode == 0:  # it was done already (a fast machine): nothing to see
        pytest.skip(f"the ingest finished within {delay} s")
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    assert "Traceback" not in err and "Aborted!" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("featurehouse: ")]
    assert ("terminated by SIGTERM" if sig == "SIGTERM" else "interrupted (Ctrl-C)") in line
    assert ("nothing was loaded" in line or "is recorded as failed" in line or "recorded as succeeded" in line
            or "`featurehouse status` says how run" in line), line


@pytest.mark.parametrize("inside_duckdb", [False, True])
def test_a_sigterm_during_the_find_refresh_says_the_run_succeeded(tmp_path, monkeypatch, inside_duckdb):
    """Issue 41 item 7: a SIGTERM while the find index refreshed after a good ingest exited 143
    with nothing on stderr (or, inside DuckDB, 0) while the run was `succeeded`."""
    import signal

    from pipeline import cli as cli_module
    from pipeline.outputs import find

    wh = tmp_path / "wh"
    from click.testing import CliRunner

    runner = CliRunner()
    assert runner.invoke(cli, ["ingest", str(FIXTURES), "--warehouse", str(wh), "--no-progress"]).exit_code == 0
    assert runner.invoke(cli, ["index", "--warehouse", str(wh)]).exit_code == 0
    page = tmp_path / "new" / "p.json"
    page.parent.mkdir()
    from bench.generate import synthetic_page
    from tests.formats import to_api_json

    page.write_bytes(to_api_json(synthetic_page(9, source="other-src")))

    def refresh(settings):
        if inside_duckdb:
            import duckdb

            from tests.conftest import statement_a_signal_interrupts

            with duckdb.connect() as conn:
                statement_a_signal_interrupts(conn)
        else:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(find, "refresh_index", refresh)
    before = signal.getsignal(signal.SIGTERM)
    try:
        result = runner.invoke(cli, ["ingest", str(page.parent), "--warehouse", str(wh), "--no-progress"])
    finally:
        signal.signal(signal.SIGTERM, before)
        cli_module._TERMINATED.clear()
    assert result.exit_code == 143, result.output
    assert "while refreshing the find index" in result.output and "recorded as succeeded" in result.output
    assert query(wh, "SELECT status FROM runs ORDER BY started_at DESC LIMIT 1") == [("succeeded",)]


def _ingest_in_process(wh: Path):
    """``featurehouse ingest`` of the fixtures in this process (a step patched to send a signal),
    the process's signal handlers and the CLI's record of signals put back after."""
    import signal

    from click.testing import CliRunner

    from pipeline import cli as cli_module

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return CliRunner().invoke(cli, ["ingest", str(FIXTURES), "--warehouse", str(wh), "--no-progress"])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        cli_module._TERMINATED.clear()


def test_a_signal_whose_exception_was_swallowed_still_stops_the_ingest(tmp_path, monkeypatch):
    """Found by the signal test on a loaded machine (CI, about one run in ten): a Ctrl-C whose
    handler raised inside a Python callback DuckDB made during a query (its lookup of a Python
    object named like a missing table, while the warehouse was opened) was swallowed with the
    error the code expected there; the run loaded everything and exited 0. Now the run stops at
    its next point that may and says how it is recorded."""
    import signal

    from pipeline.lake import warehouse as warehouse_module

    real = warehouse_module.connect

    def connect(*args, **kwargs):  # the handler raises here, and the exception goes no further
        try:
            signal.raise_signal(signal.SIGINT)
            sum(range(10))  # (the handler runs between two instructions: here at the latest)
        except BaseException:
            pass
        return real(*args, **kwargs)

    wh = tmp_path / "wh"

    monkeypatch.setattr(warehouse_module, "connect", connect)
    result = _ingest_in_process(wh)
    assert result.exit_code == 130, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("featurehouse: ")]
    assert "ingest interrupted (Ctrl-C)" in line, line
    monkeypatch.undo()
    assert query(wh, "SELECT count(*) FROM features") == [(0,)]
    runs = query(wh, "SELECT status FROM runs")  # what the line says is what the warehouse holds
    assert ("no run was recorded: nothing was loaded" in line and runs == []) or \
        ("is recorded as failed" in line and runs == [("failed",)]), (line, runs)


def test_a_second_ctrl_c_while_the_run_records_its_failure_waits(tmp_path, monkeypatch):
    """Found from outside: a Ctrl-C, then another while the stopping run recorded its failure,
    raised inside that recording: the run stayed `running`, with a traceback. Now the second
    waits; the run is recorded as failed and the one line says so."""
    import signal

    from pipeline.lake import runstate

    start, finish = runstate.start_run, runstate.finish_run

    def start_then_ctrl_c(*args, **kwargs):
        start(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        sum(range(10))  # (the handler runs between two instructions: here at the latest)

    def ctrl_c_then_finish(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        sum(range(10))
        return finish(*args, **kwargs)

    monkeypatch.setattr(runstate, "start_run", start_then_ctrl_c)
    monkeypatch.setattr(runstate, "finish_run", ctrl_c_then_finish)
    wh = tmp_path / "wh"
    result = _ingest_in_process(wh)
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output and "could not record" not in result.output, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("featurehouse: ")]
    monkeypatch.undo()
    (run_id, status), = query(wh, "SELECT run_id, status FROM runs")
    assert status == "failed" and f"run {run_id} is recorded as failed" in line, line


def test_a_ctrl_c_as_the_process_exits_says_what_stands():
    """Found from outside: a Ctrl-C just after an ingest's summary (the interpreter's teardown)
    ended the process with exit 130 and no word. Now its line says the run stands."""
    code = ("import signal\nfrom pipeline import cli\n"
            "signal.signal(signal.SIGINT, cli._terminated)\n"
            "cli._DONE.append('run r1 is recorded as succeeded (its data is loaded)')\n"
            "cli._teardown_signals()\nsignal.raise_signal(signal.SIGINT)\nimport time\ntime.sleep(5)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130, r
    assert r.stderr == ("featurehouse: interrupted (Ctrl-C) as it exited; run r1 is recorded as succeeded "
                        "(its data is loaded)\n"), r.stderr


def test_verbose_after_the_command_too(warehouse):
    """Issue 45: -v worked only before the command."""
    wh, _ = warehouse
    after = fh("report", "--warehouse", str(wh), "-v")
    assert after.returncode == 0, after.stderr
    assert "INFO featurehouse: report for" in after.stderr
    assert "INFO featurehouse" not in fh("report", "--warehouse", str(wh)).stderr
    assert fh("fetch", "-v", "features", "--help").returncode == 0  # and after a group's name (review)


def _status_table_in_a_terminal(wh: Path, columns: int, command: str = "status",
                                 last: str = "warehouse holds") -> tuple[str, list[str], list[list[str]]]:
    """`featurehouse status` (or ``command``) as a terminal of ``columns`` shows it (tmux): the
    screen, the table's headings and its rows' cells; ``last`` is what the command prints last."""
    screen = _in_a_terminal(wh, columns, command, last)
    table = [ln for ln in screen.splitlines() if ln.startswith(("┌", "│", "└"))]
    assert table and max(len(ln) for ln in table) <= columns, screen
    heads = [c.strip() for c in table[1].split("│") if c.strip()]
    rows = [[c.strip() for c in ln.split("│") if c.strip()] for ln in table[3:] if ln.startswith("│")]
    return screen, heads, rows


def _in_a_terminal(wh: Path, columns: int, command: str, last: str) -> str:
    """What `featurehouse COMMAND --warehouse WH` leaves on a terminal of ``columns`` (tmux), once
    ``last`` is on it."""
    import shutil
    import time

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the terminal's width is not tried")
    sock = f"fh-{os.getpid()}-{columns}-{command}-{abs(hash(str(wh))) % 10**8}"
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-x", str(columns), "-y", "100",
                    f"{FEATUREHOUSE} {command} --warehouse {wh}; echo '(the command ended)'; sleep 30"], check=True)
    try:
        deadline = time.monotonic() + 60
        screen = ""
        while not (last in screen and "(the command ended)" in screen) and time.monotonic() < deadline:
            time.sleep(0.3)
            screen = subprocess.run(["tmux", "-L", sock, "capture-pane", "-p"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    assert last in screen and "(the command ended)" in screen, screen
    return screen.replace("(the command ended)", "")


def test_status_fits_a_terminal_and_wide_shows_every_count(warehouse):
    """Issue 45: `status` was ~340 characters wide, then at 80 columns DuckDB's renderer hid all but
    four columns behind "…" (the why among them). In a terminal of 80 or 100 columns (tmux) it
    fits and shows the run, its verdict and why; --wide shows every count; failure counts say what
    they are out of."""
    wh, _ = warehouse
    narrow = fh("status", "--warehouse", str(wh))
    assert "activations" not in narrow.stdout.split("warehouse holds")[0] and "why" in narrow.stdout
    assert "more columns: featurehouse status --wide" in narrow.stdout
    wide = fh("status", "--warehouse", str(wh), "--wide").stdout
    assert "activations" in wide and "more columns" not in wide
    assert "1 of 2 " in wide and "1 of 31 " in wide and "1 of 42 " in wide  # rejected, failed checks, quarantined
    for columns in (80, 100):
        screen, heads, _ = _status_table_in_a_terminal(wh, columns)
        assert {"run_id", "verdict", "why"} <= set(heads) and "…" not in heads, heads
        assert "│ 1 of 2 input(s)" in screen  # the why, cut to the line, still says it


def test_sql_and_find_answers_fit_the_terminal_and_are_whole_in_a_pipe(warehouse):
    """Review: at 80 columns the README's `sql "SELECT * FROM feature_activation_stats ..."` printed
    rows ~700 characters long that wrapped into noise, and search's long descriptions wrapped.
    In a terminal, a table is as wide as it (DuckDB's own CLI's way: long values cut, the middle
    columns left out and counted below); a description gives way; into a pipe, all of it."""
    wh, _ = warehouse
    sql = "sql 'SELECT * FROM feature_activation_stats'"
    screen = _in_a_terminal(wh, 80, sql, "shown)")
    lines = [ln for ln in screen.splitlines() if ln.strip()]
    assert max(len(ln) for ln in lines) <= 80, screen
    assert re.search(r"\d+ columns \(\d+ shown\)", screen), screen
    piped = fh("sql", "SELECT * FROM feature_activation_stats", "--warehouse", str(wh)).stdout
    assert "shown)" not in piped and "top_tokens" in piped and max(len(ln) for ln in piped.splitlines()) > 80

    search = "search cpu"
    screen = _in_a_terminal(wh, 80, f"{search} --refresh", "description")
    assert max(len(ln) for ln in screen.splitlines()) <= 80, screen
    assert "gpt-oss-20b" in screen and "more column(s)" in screen, screen  # the key stays, what went is said
    piped = fh(*search.split(), "--warehouse", str(wh)).stdout
    assert max(len(ln) for ln in piped.splitlines()) > 80 and "more column" not in piped, piped


def test_status_at_80_columns_keeps_the_verdict_of_a_run_with_a_long_id(tmp_path):
    """Review: a nightly run's id is 45 characters (airflow-featurehouse_nightly-...), and at 80
    columns status kept only run_id and why: the verdict and status were gone. The verdict, the
    run (its id cut in the middle) and why are always shown; the failure count a run holds comes
    before the other counts."""
    wh = tmp_path / "wh"
    run_id = "airflow-featurehouse_nightly-20261130T030000Z"
    assert fh("ingest", str(FIXTURES), "--warehouse", str(wh), "--run-id", run_id, "--no-progress").returncode == 0
    _, heads, [row] = _status_table_in_a_terminal(wh, 80)
    assert {"run_id", "verdict", "why"} <= set(heads), heads
    assert row[heads.index("verdict")] == "WARN" and row[heads.index("why")].startswith("1 of 2 input(s)"), row
    assert row[heads.index("run_id")].endswith("20261130T030000Z"), row  # cut in its middle, its time whole


def test_ingest_and_status_give_one_duration(tmp_path):
    """Issue 45: the same run was "26.2s" in ingest's summary and 20.4 in status (status counted
    from after the warehouse was opened). Both are the span between the two times ``runs``
    records, so they agree to the summary's rounding however long a commit takes (they once
    differed by 0.3 s on a loaded machine: the summary took its end after the report's commit)."""
    wh = tmp_path / "wh"
    out = json.loads(fh("ingest", str(FIXTURES), "--warehouse", str(wh), "--no-progress", "--format", "json").stdout)
    (row,) = json.loads(fh("status", "--warehouse", str(wh), "--format", "json").stdout)
    assert abs(row["seconds"] - out["seconds"]) <= 0.0005 + 1e-9, (row["seconds"], out["seconds"])
    # what the table's failure counts are out of (review): 2 inputs asked for, 42 records read
    assert (row["n_fetch_counted"], row["n_records_read"]) == (2, 42), row
    # and that duration is the whole run's, its report included (review: it ended before the report)
    import datetime

    written = datetime.datetime.fromtimestamp(Path(row["report_path"]).stat().st_mtime, datetime.timezone.utc)
    assert datetime.datetime.fromisoformat(row["finished_at"]).replace(tzinfo=datetime.timezone.utc) >= written


def test_config_shows_what_the_dags_and_fetch_read_and_every_variable(tmp_path):
    """Issue 45 review: `featurehouse config` listed the warehouse's settings only; the nightly's
    featurehouse.toml values ($FEATUREHOUSE_CONFIG, [fetch], NEURONPEDIA_*) and the variables read
    where they are used were nowhere. Every variable the program reads is now a row (with where its
    value came from), a secret is never printed, and a mistake in the toml exits 1 after the rest."""
    toml = tmp_path / "fh.toml"
    toml.write_text((ROOT / "featurehouse.toml").read_text().replace("chunk_size = 500", "chunk_size = 250"))
    env = {"FEATUREHOUSE_CONFIG": str(toml), "FEATUREHOUSE_MAX_FAILED_FRACTION": "0.2",
           "NEURONPEDIA_API_KEY": "sk-very-secret", "NEURONPEDIA_BASE_URL": "http://127.0.0.1:9/",
           "FEATUREHOUSE_DUCKDB_MEMORY": "3GB"}
    proc = fh("config", "--warehouse", str(tmp_path / "w"), "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "sk-very-secret" not in proc.stdout
    rows = {r["setting"]: (r["value"], r["from"]) for r in json.loads(proc.stdout)}
    assert rows["config file"] == (str(toml), "$FEATUREHOUSE_CONFIG")
    assert rows["[fetch] chunk_size"] == ("250", "fh.toml") and rows["[fetch] concurrency"] == ("4", "fh.toml")
    assert rows["[fetch] max_failed_fraction"] == ("0.2", "$FEATUREHOUSE_MAX_FAILED_FRACTION")
    assert rows["[neuronpedia] base_url"] == ("http://127.0.0.1:9", "$NEURONPEDIA_BASE_URL")
    assert rows["api_key"] == ("***", "$NEURONPEDIA_API_KEY") and rows["duckdb_memory"] == ("3GB", "$FEATUREHOUSE_DUCKDB_MEMORY")
    assert rows["[[sources]]"][0] == "gpt-oss-20b/11-resid-post-aa (1,002 indices)"
    used = set(subprocess.run(  # every variable the program reads (not the Docker deployment's own)
        ["grep", "-rhoE", r"(FEATUREHOUSE|NEURONPEDIA)_[A-Z0-9_]*[A-Z0-9]", "pipeline", "dags", "--include=*.py"],
        cwd=ROOT, capture_output=True, text=True).stdout.split()) - {"FEATUREHOUSE_MAX"}
    shown = " ".join(r["variables"] for r in json.loads(proc.stdout))
    assert sorted(v for v in used if f"${v}" not in shown) == []
    gone = fh("config", "--warehouse", str(tmp_path / "w"), env=env | {"FEATUREHOUSE_CONFIG": str(tmp_path / "no.toml")})
    assert gone.returncode == 1 and f"no config file at {tmp_path / 'no.toml'} (FEATUREHOUSE_CONFIG names it)" in gone.stderr
    # in a terminal of 80 columns (review: the table was 166 wide): setting, value and from, a long
    # value cut in its middle; the variables in --wide, and every column whole into a pipe
    wide_value = str(tmp_path / ("a-long-warehouse-folder-name-" * 3) / "w")
    screen, heads, rows = _status_table_in_a_terminal(Path(wide_value), 80, "config", "config --wide")
    assert heads == ["setting", "value", "from"] and "featurehouse config --wide" in screen, screen
    (shown,) = [r[1] for r in rows if r[0] == "warehouse"]
    assert "…" in shown and shown.endswith("-name-/w") and wide_value.startswith(shown.split("…")[0]), shown
    piped = fh("config", "--warehouse", wide_value, env=env)
    assert wide_value in piped.stdout and "$FEATUREHOUSE_S3_ENDPOINT, $AWS_ENDPOINT_URL_S3" in piped.stdout
    toml.write_text(toml.read_text().replace("chunk_size = 250", "chunk_sise = 250"))
    broken = fh("config", "--warehouse", str(tmp_path / "w"), env=env)
    assert broken.returncode == 1 and "chunk_sise" in broken.stderr and "batch_bytes" in broken.stdout
