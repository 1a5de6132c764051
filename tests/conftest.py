"""Shared fixtures: the seed captures, read independently of the pipeline, and warehouses in tmp_path."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import duckdb
import pytest

from pipeline.config import Settings
from tests.formats import UNDEFINED, parse_js_iso

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEED_FLIGHT = FIXTURES / "000_e9e35889d0228029.txt"
SEED_NOT_A_PAGE = FIXTURES / "002_cdcf7f83dd4b10f8.txt"
#: The seed activation whose tokens (986) and values (992) differ in length.
BAD_ACTIVATION = "d8mimkvxz30oar3222exnhh6"

#: Columns that say when and from where a row was loaded, not what it holds.
META_COLUMNS = ("input_sha256", "run_id", "loaded_at", "refreshed_at", "quarantined_at", "received_at",
                "captured_at")


#: Seconds a module's tests took together (fresh clone, 2 cores, 2026-12-01), rounded: only
#: orders the groups xdist hands out, longest first, so the two workers end together. A module
#: not listed counts half a second a test; a test marked ``heavy`` counts its own seconds. A
#: group named with ``xdist_group`` is looked up by its name first ("publish" was not listed:
#: ~13 s by its 26 tests, so handed out last, it ran 470 s alone at the end of the suite).
MODULE_SECONDS = {
    "publish": 330, "publish-s3": 65,  # tests/test_publish.py's two groups (measured 2026-12-07)
    "test_docs_examples": 180, "test_report_layout": 45,
    "test_airflow_dags_test": 240, "test_sql_readonly": 160, "test_golden": 80, "test_ingest": 75,
    "test_snapshots": 75, "test_warehouse_portable": 75, "test_find": 60, "test_timezones": 55,
    "test_inbox": 50, "test_report": 50, "test_cli": 50, "test_sql_sandbox": 45, "test_fetch": 45,
    "test_lakehouse": 45, "test_dags": 40, "test_rerun_cost": 40, "test_signals": 35, "test_fetch_exports": 35,
    "test_bad_inputs": 35, "test_every_field": 35, "test_land": 30, "test_disk_full": 10,
}


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")  # xdist_group("x") or xdist_group(name="x")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _weight(item) -> float:
    mark = item.get_closest_marker("heavy")
    return float(mark.args[0]) if mark and mark.args else 0.0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``) a module's tests stay together on
    one worker, so its module-scoped fixtures (a warehouse ingested once, an Airflow home) are
    built once; a test may name a group of its own with ``@pytest.mark.xdist_group``.

    A test marked ``@pytest.mark.heavy(seconds)`` (a minute of real processes, say) is a group
    of its own, so two of them run on two workers at once rather than one after another in their
    module's group. Groups go out longest first (``--no-loadscope-reorder`` keeps this order
    when xdist hands them out: ``heavy`` seconds, else ``MODULE_SECONDS``), so the workers end
    together instead of one finishing a long group alone at the end."""
    seconds: dict[str, float] = {}
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            own = any(m.name == "heavy" for m in item.own_markers)
            item.add_marker(pytest.mark.xdist_group(item.nodeid if own else item.module.__name__))
        group = _group(item)
        module = item.module.__name__.rpartition(".")[2]
        seconds[group] = _weight(item) if group == item.nodeid else MODULE_SECONDS.get(
            group, MODULE_SECONDS.get(module, seconds.get(group, 0.0) + 0.5))
    items.sort(key=lambda item: -seconds[_group(item)])  # stable


#: Where each test's CPU seconds are written, when the environment names a file (``make
#: test-cpu``): this process's (DuckDB's threads too) and its waited-for children's, from
#: ``getrusage``, user + system, across the test's set-up, call and tear-down (a module
#: fixture's cost falls on its first test). What the wall-time ``--durations`` cannot say on a
#: loaded machine: where the suite's CPU goes, which is what its time on 2 cores is made of.
_CPU_LOG = os.environ.get("FEATUREHOUSE_TEST_CPU")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before = _cpu_seconds()
        yield
        with open(_CPU_LOG, "a", encoding="utf-8") as log:  # a line a write: the workers append whole lines
            log.write(f"{_cpu_seconds() - before:.3f}\t{item.nodeid}\n")


def pytest_collection_finish(session):
    """Fail at once where pytest-xdist did not apply the groups: pytest 9 derives a test's id
    from another attribute than the one xdist 3.8 appends ``@group`` to, and then every test was
    a group of its own — module fixtures built again on each worker (pyproject pins pytest < 9)."""
    config = session.config
    if getattr(config.option, "loadgroup", False) and session.items and "@" not in session.items[0].nodeid:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup did not group the tests (pytest {pytest.__version__}): "
            "module fixtures would be built on every worker")


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        children = obj.values()
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for child in children:
        found = _find(child, key)
        if found is not None:
            return found
    return None


def _undo_flight(v):
    """The seed's initialNeuron uses only $D dates and $undefined; anything else is a surprise."""
    if isinstance(v, str) and v.startswith("$"):
        if v.startswith("$D"):
            return parse_js_iso(v[2:])
        if v == "$undefined":
            return UNDEFINED
        raise AssertionError(f"unexpected flight encoding in the seed page: {v[:20]!r}")
    if isinstance(v, dict):
        return {k: x for k, x in ((k, _undo_flight(x)) for k, x in v.items()) if x is not UNDEFINED}
    if isinstance(v, list):
        return [_undo_flight(x) for x in v]
    return v


@functools.lru_cache(maxsize=1)
def _seed_page() -> dict:
    first_line = SEED_FLIGHT.read_bytes().split(b"\n", 1)[0]
    assert first_line.startswith(b"8:")
    page = _find(json.loads(first_line[2:]), "initialNeuron")
    assert isinstance(page, dict)
    return _undo_flight(page)


@pytest.fixture
def seed_page() -> dict:
    """The seed's feature page as a plain dict (dates as datetimes), read with json, not our parser."""
    return copy.deepcopy(_seed_page())


def seed_page_copy() -> dict:
    return copy.deepcopy(_seed_page())


def good_page(index: int = 7, *, model: str = "gpt-oss-20b", source: str = "11-resid-post-aa") -> dict:
    """A small page that passes every expectation: 3 activations (Chat, Non-Chat, NULL source)."""
    key = {"modelId": model, "layer": source, "index": str(index)}
    acts = []
    for i, (ds, values) in enumerate([
        ("Chat", [0.0, 1.5, 3.25, 0.0]),
        ("Non-Chat", [2.0, 0.0, 0.0]),
        (None, [0.0, 0.5]),
    ]):
        mx = max(values)
        acts.append({
            "id": f"act-{model}-{source}-{index}-{i}", **key, "dataSource": ds,
            "tokens": [f"t{i}_{j}" for j in range(len(values))], "values": values,
            "maxValue": mx, "maxValueTokenIndex": values.index(mx), "minValue": min(values),
            "dfaValues": [], "lossValues": [], "binMin": -1, "binMax": -1, "binContains": -1,
            "createdAt": datetime(2025, 9, 24, 4, 45, 9, 601000),
        })
    return {
        **key, "sourceSetName": "resid-post-aa", "maxActApprox": 3.25, "frac_nonzero": 0.001,
        "pos_str": ["a", "b"], "pos_values": [0.1, 0.05], "neg_str": ["c"], "neg_values": [-0.1],
        "hookName": None, "hasVector": False, "createdAt": datetime(2025, 9, 24, 4, 30, 34, 656000),
        "model": {"id": model, "displayName": model.upper(), "layers": 24, "dimension": 2880, "owner": "OpenAI"},
        "source": {"id": source, "modelId": model, "setName": "resid-post-aa", "num_tokens_in_prompt": 1024},
        "sourceSet": {"modelId": model, "name": "resid-post-aa", "description": "Resid Post", "urls": ["https://x"]},
        "activations": acts,
        "explanations": [{"id": f"exp-{model}-{source}-{index}", "description": "cpu things",
                          "explanationModelName": "gemini-2.0-flash", "typeName": "np_max-act", "scores": []}],
    }


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(warehouse=tmp_path / "wh")


def open_warehouse(warehouse: Path | Settings) -> duckdb.DuckDBPyConnection:
    """The warehouse read-only, as `featurehouse sql` opens it (a folder resolves the rest from
    the environment)."""
    from pipeline.lake import warehouse as wh

    return wh.connect(warehouse, read_only=True)


def query(warehouse: Path | Settings, sql: str, params=None) -> list[tuple]:
    with open_warehouse(warehouse) as conn:
        return conn.execute(sql, params or []).fetchall()


def reads(warehouse: Path | Settings, *statements) -> list[list[tuple]]:
    """The rows of each of ``statements`` (SQL, or ``(SQL, parameters)``), read through one
    connection (``query`` opens one each: ~0.35 CPU-s, its extensions loaded and checked)."""
    with open_warehouse(warehouse) as conn:
        return [conn.execute(*((s, []) if isinstance(s, str) else s)).fetchall() for s in statements]


def table_rows(warehouse: Path | Settings, table: str, exclude: tuple[str, ...] = META_COLUMNS) -> list[tuple]:
    """Every row of ``table`` without its load metadata, in a stable order."""
    with open_warehouse(warehouse) as conn:
        return _rows(conn, table, exclude)


def tables_rows(warehouse: Path | Settings, tables, exclude: tuple[str, ...] = META_COLUMNS) -> dict[str, list[tuple]]:
    """``table_rows`` of each of ``tables``, by name, read through one connection (opening one
    loads its extensions and attaches the catalog: ~0.2 s, ~0.5 s on S3 with PostgreSQL)."""
    with open_warehouse(warehouse) as conn:
        return {t: _rows(conn, t, exclude) for t in tables}


def _rows(conn: duckdb.DuckDBPyConnection, table: str, exclude: tuple[str, ...]) -> list[tuple]:
    cols = [c for (c,) in conn.execute(
        "SELECT column_name FROM duckdb_columns() WHERE database_name = 'featurehouse' AND table_name = ? "
        "ORDER BY column_index", [table]).fetchall() if c not in exclude]
    sel = ", ".join(f'"{c}"' for c in cols)
    return conn.execute(f"SELECT {sel} FROM {table} ORDER BY ALL").fetchall()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def run_ingest(inputs, settings: Settings, **kw):
    """``pipeline.ingest`` without the HTML report (another stage, tested on its own)."""
    import inspect

    from pipeline.ingest import ingest

    if "report_after" in inspect.signature(ingest).parameters:
        kw.setdefault("report_after", False)
    kw.setdefault("progress", False)
    return ingest(inputs, settings, **kw)


def statement_a_signal_interrupts(conn: duckdb.DuckDBPyConnection, after: float = 0.3) -> None:
    """A DuckDB statement that runs until a SIGTERM this process sends itself ``after`` seconds in
    interrupts it (DuckDB raises "Query interrupted"; the handler's own exception where none is
    caught inside DuckDB). Its exception is raised as it came; first the statement's work is
    stopped: DuckDB's worker threads went on with the 10^10 rows after the Python side raised, and
    the connection's next statement (the run's ROLLBACK) waited for them all (measured: 60-140 s
    and ~50 CPU-s, about one run in three; ``conn.interrupt()`` ends them at once)."""
    import os
    import signal
    import threading

    timer = threading.Timer(after, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        conn.execute("SELECT count(*) FROM range(10000000000) t(i) WHERE hash(i) = 0").fetchall()
    except BaseException:
        conn.interrupt()
        raise
    finally:
        timer.cancel()


def _empty_warehouse(tmp_path):
    from pipeline.config import Settings
    from pipeline.lake import warehouse as wh

    settings = Settings(warehouse=tmp_path / "wh")
    wh.connect(settings, create=True).close()
    return settings.warehouse


#: The system's Chromium (apt's: .ci/run installs it), which Playwright drives in the browser tests.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def chromium():
    """Chromium under Playwright, one per test module; a failure where it is missing (.ci/run
    installs it): a browser test that skips would hold nothing."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: .ci/run installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        yield b
        b.close()


#: A process that holds the warehouse's SQLite catalog as one stopped while it rebuilds the catalog's
#: WAL index (https://www.sqlite.org/walformat.html): the index open (its DMS byte, 128, shared), its
#: WRITE, CKPT and RECOVER locks (bytes 120-122) held, its header not yet written. A publication's
#: every read of the warehouse opens the catalog anew and, alone, rebuilds the index (strace: ~14
#: rebuilds a publication); stopped in one (caught with strace after its catalog copy had begun) it
#: held these, and every other reader of the catalog failed: "database is locked" (the index mapped,
#: as here), or "locking protocol" after ~95 s of retries (a moment earlier: the index file emptied,
#: which this cannot do under a reader that has it mapped, as the stopped publication may).
_REBUILDING = """
import fcntl, os, sys
fd = os.open(sys.argv[1] + "-shm", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 128)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 3, 120)
os.pwrite(fd, bytes(136), 0)
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def catalog_held_rebuilding_wal_index(settings: Settings):
    """The warehouse's catalog held as by a process stopped while it rebuilds the WAL index, until
    the block ends; the process holding it is the block's value."""
    h = subprocess.Popen([sys.executable, "-c", _REBUILDING, str(settings.warehouse / "catalog.sqlite")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert h.stdout.readline().strip() == "held", h.communicate()[1]
        yield h
    finally:
        h.communicate()  # its stdin closed: it ends, and the next reader rebuilds the index
