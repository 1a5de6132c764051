"""Issue 17 ("Hardening 2"), items 3, 4, 7, 8, 9 and 10: what an outside review found wrong.

3. bytes equal to an older capture were skipped as "already landed", so the newest capture lost;
4. one activation id in two features gave different tables in one run and in two;
7. a full disk under the landing area was blamed on the inputs, and the run stayed `running`;
8. a folder that cannot be read, or a link to a folder, was skipped without a word;
9. `history` and `changes` missed a feature whose activations another capture took;
10. a damaged old warehouse crashed `migrate`; a broken link was named by its target; the run
    summary's input counts did not add up; CSV wrote nested values as Python reprs.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.lake.history import changes_since, feature_history, parse_key
from pipeline.lake.legacy import LegacyMigrationError, migrate_file
from pipeline.lake.runstate import RunSummary
from pipeline.lake.warehouse import connect
from tests.conftest import good_page, query, run_ingest, table_rows, write
from tests.formats import to_api_json
from tests.test_snapshots import T0, V1, _at, _state, page_v

ROOT = Path(__file__).resolve().parent.parent
FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
JAN, FEB, MAR = T0, T0 + timedelta(days=31), T0 + timedelta(days=59)


def fh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _adds_up(s) -> None:
    """Every input a run received is in one category of each kind."""
    d = s if isinstance(s, dict) else s.as_dict()
    assert d["n_received"] == d["n_landed"] + d["n_reread"] + d["n_duplicates"] + d["n_unread"], d
    assert d["n_received"] == d["n_loaded"] + d["n_rejected"] + d["n_duplicates"], d


# --- 3. the newest capture wins, whatever its bytes ----------------------------------------------


def _captures(settings: Settings) -> set:
    return set(query(settings.warehouse, "SELECT table_name, captured_at FROM feature_captures"))


def test_the_newest_capture_wins_when_its_bytes_equal_an_older_one(tmp_path, settings):
    """t1 (v1, Jan), t2 (v2, Feb), t3 (a copy of t1's bytes, Mar): t3 was skipped as already
    landed and the warehouse kept v2. Three runs, and one run, now end with v1 captured in March."""
    t1 = _at(write(tmp_path / "a" / "t1.json", to_api_json(page_v(1))), JAN)
    t2 = _at(write(tmp_path / "b" / "t2.json", to_api_json(page_v(2))), FEB)
    t3 = _at(write(tmp_path / "c" / "t3.json", t1.read_bytes()), MAR)
    for path in (t1, t2):
        run_ingest([path], settings)
    s = run_ingest([t3], settings)
    assert _state(settings) == V1, "the newest capture (t3, the bytes of v1) must win"
    assert _captures(settings) == {(t, MAR) for t in ("features", "activations", "explanations")}
    assert (s.n_received, s.n_reread, s.n_duplicates, s.n_loaded, s.n_features) == (1, 1, 0, 1, 1)
    _adds_up(s)
    assert query(settings.warehouse, "SELECT captured_at FROM raw_inputs WHERE origin = ?", [str(t1)]) == [(MAR,)]

    one_run = Settings(warehouse=tmp_path / "one-run")
    s = run_ingest([t1, t2, t3], one_run)
    assert _state(one_run) == V1 and _captures(one_run) == _captures(settings)
    _adds_up(s)


def test_a_newer_copy_of_what_is_loaded_moves_its_capture_time_without_reading_it(tmp_path, settings):
    """The same bytes captured later change nothing but the capture's time, which later
    decisions compare with: a capture made in between (v2, Feb) then arrives too late."""
    t1 = _at(write(tmp_path / "a" / "t1.json", to_api_json(page_v(1))), JAN)
    run_ingest([t1], settings)
    s = run_ingest([_at(write(tmp_path / "c" / "t3.json", t1.read_bytes()), MAR)], settings)
    assert (s.n_received, s.n_duplicates, s.n_reread, s.n_loaded) == (1, 1, 0, 0), "read again for nothing"
    assert _captures(settings) == {(t, MAR) for t in ("features", "activations", "explanations")}
    with connect(settings, read_only=True) as conn:
        assert changes_since(conn, s.run_id)[1] == [], "the same bytes captured again are no change"
        assert len(feature_history(conn, parse_key("gpt-oss-20b/11-resid-post-aa/7"))) == 1
    late = run_ingest([_at(write(tmp_path / "b" / "t2.json", to_api_json(page_v(2))), FEB)], settings)
    assert late.n_superseded == 3 and _state(settings) == V1


# --- 4 and 9. one activation id in two features -------------------------------------------------


def _rival_pages() -> tuple[dict, dict]:
    """Feature 1, and feature 2 whose page also lists two of feature 1's activations."""
    one, two = good_page(1), good_page(2)
    for a in one["activations"][:2]:
        two["activations"].append({**copy.deepcopy(a), "index": "2"})
    return one, two


STATE_TABLES = ("features", "activations", "explanations", "feature_activation_stats", "source_activation_stats")


def _tables(settings: Settings) -> dict[str, list]:
    return {t: table_rows(settings.warehouse, t) for t in STATE_TABLES}


@pytest.fixture(scope="module")
def rivals(tmp_path_factory):
    """The two pages (feature 1 captured in January, feature 2 in February) loaded in one run,
    in two runs in capture order, and in two runs the other way round."""
    root = tmp_path_factory.mktemp("rivals")
    one, two = _rival_pages()
    p1 = _at(write(root / "in" / "1.json", to_api_json(one)), JAN)
    p2 = _at(write(root / "in" / "2.json", to_api_json(two)), FEB)
    out = {}
    for name, runs in {"one run": [[p1, p2]], "two runs": [[p1], [p2]], "newer first": [[p2], [p1]]}.items():
        settings = Settings(warehouse=root / name.replace(" ", "-"))
        out[name] = (settings, [run_ingest(paths, settings, run_id=f"r{i}").run_id for i, paths in enumerate(runs)])
    return out


def test_an_id_in_two_features_gives_the_same_tables_however_the_pages_are_batched(rivals):
    """One run quarantined both copies of the ids (72 activations) where two runs moved them to
    the later capture (75). One rule now: the newer capture keeps each id."""
    expected = _tables(rivals["two runs"][0])
    owners = dict(query(rivals["two runs"][0].warehouse,
                        "SELECT feature_index, count(*) FROM activations GROUP BY 1 ORDER BY 1"))
    assert owners == {1: 1, 2: 5}, "feature 2 (the newer capture) keeps the two ids"
    for name in ("one run", "newer first"):
        settings = rivals[name][0]
        assert _tables(settings) == expected, name
        assert query(settings.warehouse, "SELECT count(*) FROM quarantine") == [(0,)], name


def test_on_equal_capture_times_the_larger_digest_keeps_the_id_in_any_batching(tmp_path):
    one, two = _rival_pages()
    p1 = _at(write(tmp_path / "in" / "1.json", to_api_json(one)), JAN)
    p2 = _at(write(tmp_path / "in" / "2.json", to_api_json(two)), JAN)
    together, apart = Settings(warehouse=tmp_path / "together"), Settings(warehouse=tmp_path / "apart")
    run_ingest([p1, p2], together)
    run_ingest([p2], apart)
    run_ingest([p1], apart)
    assert _tables(together) == _tables(apart)
    (winner,) = query(together.warehouse, "SELECT max(input_sha256) FROM raw_inputs")[0]
    shared = [a["id"] for a in one["activations"][:2]]
    assert {r[0] for r in query(together.warehouse, "SELECT DISTINCT input_sha256 FROM activations WHERE "
                                "list_contains(?, activation_id)", [shared])} == {winner}


def test_a_newer_copy_of_a_page_takes_back_the_ids_an_older_capture_took(tmp_path):
    """Captures in order: feature 1 (Jan), feature 2 (Feb) with two of its ids, feature 1 again
    (the same bytes, Mar): the ids are feature 1's again, in three runs as in one."""
    one, two = _rival_pages()
    p1 = _at(write(tmp_path / "a" / "1.json", to_api_json(one)), JAN)
    p2 = _at(write(tmp_path / "b" / "2.json", to_api_json(two)), FEB)
    p1_again = _at(write(tmp_path / "c" / "1.json", p1.read_bytes()), MAR)
    runs, together = Settings(warehouse=tmp_path / "runs"), Settings(warehouse=tmp_path / "together")
    for path in (p1, p2):
        run_ingest([path], runs)
    s = run_ingest([p1_again], runs)
    assert (s.n_reread, s.n_loaded) == (1, 1), "rows of its were taken: the newer capture reads it again"
    run_ingest([p1, p2, p1_again], together)
    owners = dict(query(runs.warehouse, "SELECT feature_index, count(*) FROM activations GROUP BY 1 ORDER BY 1"))
    assert owners == {1: 3, 2: 3}
    assert _tables(runs) == _tables(together)


def test_history_and_changes_show_the_feature_that_lost_activations(rivals):
    """Feature 1 went from 3 activations to 1 when feature 2's capture took two: `changes` listed
    only feature 2 and `history` still showed 3."""
    settings, (first, second) = rivals["two runs"]
    with connect(settings, read_only=True) as conn:
        _, changes = changes_since(conn, second)
        versions = feature_history(conn, parse_key("gpt-oss-20b/11-resid-post-aa/1"))
    by_feature = {c["feature"]: c for c in changes}
    assert set(by_feature) == {"gpt-oss-20b/11-resid-post-aa/1", "gpt-oss-20b/11-resid-post-aa/2"}
    lost = by_feature["gpt-oss-20b/11-resid-post-aa/1"]
    assert lost["change"] == "changed" and {"field": "n_activations", "before": 3, "after": 1} in lost["what"]
    assert [(v["run_id"], v["n_activations"]) for v in versions] == [(first, 3), (second, 1)]
    assert versions[1]["replaced"] == [] and versions[1]["lost"] == ["activations"]

    out = fh("changes", "--since", second, "--warehouse", str(settings.warehouse), "--format", "csv")
    assert out.returncode == 0, out.stderr
    rows = {r["feature"]: r for r in csv.DictReader(io.StringIO(out.stdout))}
    what = json.loads(rows["gpt-oss-20b/11-resid-post-aa/1"]["what"])  # JSON text, not a Python repr
    assert {"field": "n_activations", "before": 3, "after": 1} in what


# --- 7. a full disk under the landing area -------------------------------------------------------


def _small_disk(folder: Path) -> str:
    """A 2 MiB file system at ``folder`` (a tmpfs); how it was made, or "" when it cannot be."""
    folder.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(folder)], capture_output=True)
    return "tmpfs" if proc.returncode == 0 else ""


def test_a_full_disk_under_the_landing_area_fails_the_run_with_that_reason(tmp_path):
    """Each input was reported as "it could not be read: No space left on device", then a
    traceback, and the run stayed `running`."""
    disk = tmp_path / "disk"
    how = _small_disk(disk)
    inputs = tmp_path / "in"
    write(inputs / "a.json", to_api_json(good_page(1)))
    write(inputs / "b_big.txt", os.urandom(3 << 20))  # larger than the whole disk
    write(inputs / "c.json", to_api_json(good_page(3)))
    wh = disk / "wh"
    try:
        if how:
            proc = fh("ingest", str(inputs), "--warehouse", str(wh), "--no-progress")
        else:  # no mount here: the same failure from a file size limit (EFBIG instead of ENOSPC)
            limit = "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); " \
                    "resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))"
            proc = subprocess.run(
                [sys.executable, "-c", f"{limit}\nfrom pipeline.cli import main; main()", "ingest", str(inputs),
                 "--warehouse", str(wh), "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert f"the landing area {wh / 'landing'} could not be written" in proc.stderr, proc.stderr
        if how:
            assert "No space left on device (the disk that holds it is full)" in proc.stderr
        assert "could not be read" not in proc.stdout + proc.stderr
        assert "is recorded as failed" in proc.stderr
        status, error = query(wh, "SELECT status, error FROM runs")[0]
        assert status == "failed" and "LandingFailed: the landing area" in error
        assert not list((wh / "landing").rglob(".landing-*")), "the partial copy is removed"
    finally:
        if how:
            subprocess.run(["umount", "-l", str(disk)], check=False)


# --- 8. folders that cannot be read, links to folders --------------------------------------------


def test_a_linked_folder_is_followed_a_loop_and_a_broken_link_are_refused_by_their_own_names(tmp_path, settings):
    """A symlinked subfolder was skipped ("received 1, rejected 0"); a broken link was reported
    under its target's name."""
    folder = tmp_path / "in"
    write(folder / "a.json", to_api_json(good_page(1)))
    write(tmp_path / "elsewhere" / "b.json", to_api_json(good_page(2)))
    (folder / "linked").symlink_to(tmp_path / "elsewhere")
    (folder / "sub").mkdir()
    (folder / "sub" / "loop").symlink_to(folder)
    (folder / "gone.json").symlink_to(tmp_path / "nowhere.json")
    s = run_ingest([folder], settings)
    assert sorted(r[0] for r in query(settings.warehouse, "SELECT feature_index FROM features")) == [1, 2]
    refused = {r["origin"]: r["reason"] for r in s.rejected}
    assert set(refused) == {str(folder / "gone.json"), str(folder / "sub" / "loop")}
    assert refused[str(folder / "gone.json")] == (f"it is a symbolic link to {tmp_path / 'nowhere.json'}, "
                                                  "which does not exist")
    assert "a folder that contains it (a loop)" in refused[str(folder / "sub" / "loop")]
    assert (s.n_received, s.n_loaded, s.n_rejected, s.n_unread) == (4, 2, 2, 2)
    _adds_up(s)


_AS_NOBODY = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from pipeline import Settings, ingest
    from pipeline.sources.inbox import scan_inbox
    folder, wh, inbox = map(Path, sys.argv[1:4])
    s = ingest([folder], Settings(warehouse=wh), progress=False, report_after=False)
    pending = scan_inbox(inbox)
    print(json.dumps({"summary": s.as_dict(), "ready": [str(p) for p in pending.ready],
                      "refused": [[str(p), why] for p, why in pending.refused]}))
""")


@pytest.fixture
def open_tmp():
    """A temporary folder other users can reach (pytest's own are private to this user)."""
    path = Path(tempfile.mkdtemp(prefix="featurehouse-nobody-"))
    path.chmod(0o755)
    yield path
    for p in path.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(path, ignore_errors=True)


def test_a_folder_that_cannot_be_read_is_refused_with_its_reason_in_an_ingest_and_an_inbox(open_tmp):
    """chmod 000 on a subfolder: the ingest said "received 1, rejected 0" and the inbox skipped
    it. Root reads any folder, so this runs as `nobody`."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to run as another user")
    base = open_tmp / "nobody"
    folder, inbox, wh = base / "in", base / "inbox", base / "wh"
    write(folder / "a.json", to_api_json(good_page(1)))
    write(folder / "closed" / "b.json", to_api_json(good_page(2)))
    write(inbox / "c.json", to_api_json(good_page(3)))
    write(inbox / "closed" / "d.json", to_api_json(good_page(4)))
    for p in [base, *base.rglob("*")]:
        os.chown(p, 65534, 65534, follow_symlinks=False)
    for closed in (folder / "closed", inbox / "closed"):
        closed.chmod(0)
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls", str(folder / "closed")],
                           capture_output=True)
    if probe.returncode == 0:
        pytest.skip("cannot drop privileges here: a folder with mode 000 is still readable")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           _AS_NOBODY, str(folder), str(wh), str(inbox)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    s = out["summary"]
    assert (s["n_received"], s["n_loaded"], s["n_rejected"], s["n_unread"]) == (2, 1, 1, 1), s
    _adds_up(s)
    assert s["rejected"] == [{"origin": str(folder / "closed"),
                              "reason": "it is a folder that cannot be read (Permission denied); nothing in it was read"}]
    assert out["ready"] == [str(inbox / "c.json")]
    assert out["refused"] == [[str(inbox / "closed"),
                               "it is a folder that cannot be read (Permission denied); nothing in it was read"]]


# --- 10. messages --------------------------------------------------------------------------------


def _legacy_copy(tmp_path: Path, damage) -> Path:
    root = tmp_path / "old"
    root.mkdir()
    with tarfile.open(ROOT / "tests" / "legacy" / "warehouse-0.1.tar.gz") as tar:
        tar.extractall(root, filter="data")
    old = root / "featurehouse.duckdb"
    data = bytearray(old.read_bytes())
    old.write_bytes(damage(data))
    return old


@pytest.mark.parametrize("damage", [
    pytest.param(lambda data: bytes(data[:len(data) * 9 // 10]), id="cut-short"),
    pytest.param(lambda data: bytes(data[:300_000] + bytes(20_000) + data[320_000:]), id="overwritten-block"),
])
def test_a_damaged_single_file_warehouse_is_refused_naming_the_damage(tmp_path, damage):
    """A truncated or corrupt 0.1 warehouse made `featurehouse migrate` print a traceback."""
    old = _legacy_copy(tmp_path, damage)
    target = tmp_path / "new"
    with pytest.raises(LegacyMigrationError, match="damaged or cut short") as err:
        migrate_file(old, Settings(warehouse=target))
    assert str(old) in str(err.value) and "nothing was migrated" in str(err.value)
    assert not target.exists(), "nothing is written for a file that cannot be read whole"


def test_migrate_says_what_is_wrong_without_a_traceback(tmp_path):
    old = _legacy_copy(tmp_path, lambda data: bytes(data[:len(data) * 9 // 10]))
    proc = fh("migrate", str(old), "--warehouse", str(tmp_path / "new"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "is damaged or cut short" in proc.stderr


def test_the_input_counts_add_up_after_a_size_refusal_and_with_reprocess(tmp_path, capsys):
    """"received 30, new 0, already landed 0, loaded 30": an input landed before and read again
    (a size limit raised, --reprocess) was in no category."""
    from pipeline.cli import print_summary

    paths = [write(tmp_path / "in" / f"{i}.json", to_api_json(good_page(i))) for i in (1, 2)]
    small = Settings(warehouse=tmp_path / "wh", max_input_bytes=100)
    refused = run_ingest(paths, small)
    assert (refused.n_landed, refused.n_rejected) == (2, 2)
    raised = run_ingest(paths, replace(small, max_input_bytes=Settings.max_input_bytes))
    assert (raised.n_landed, raised.n_reread, raised.n_duplicates, raised.n_loaded) == (0, 2, 0, 2)
    again = run_ingest(paths, raised_settings := replace(small, max_input_bytes=Settings.max_input_bytes),
                       reprocess=True)
    assert (again.n_reread, again.n_loaded) == (2, 2)
    skipped = run_ingest(paths, raised_settings)
    assert (skipped.n_duplicates, skipped.n_loaded) == (2, 0)
    for s in (refused, raised, again, skipped):
        _adds_up(s)
    assert query(small.warehouse, "SELECT n_received, n_landed, n_reread, n_duplicates, n_unread FROM runs "
                 "ORDER BY started_at") == [(2, 2, 0, 0, 0), (2, 0, 2, 0, 0), (2, 0, 2, 0, 0), (2, 0, 0, 2, 0)]
    print_summary(again)
    line = capsys.readouterr().out.splitlines()[1]
    assert "received 2 = new 0 + read again 2 + already landed 0 + not readable 0" in line, line


def test_csv_writes_nested_values_as_json_text(capsys):
    """`sql --format csv` and `changes --format csv` wrote [datetime.datetime(2026, 2, 1, 0, 0)]
    and {'a': None}."""
    from pipeline.cli import _print_rows

    _print_rows(["l", "s", "n", "t"], [([datetime(2026, 2, 1)], {"a": None, "b": [1.5]}, 3, datetime(2026, 2, 1))],
                "csv")
    (row,) = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert json.loads(row["l"]) == ["2026-02-01T00:00:00"]
    assert json.loads(row["s"]) == {"a": None, "b": [1.5]}
    assert (row["n"], row["t"]) == ("3", "2026-02-01 00:00:00")


def test_the_summary_line_names_every_category(capsys):
    from pipeline.cli import print_summary

    print_summary(RunSummary(run_id="r", warehouse="w", n_received=7, n_landed=1, n_reread=2, n_duplicates=3,
                             n_unread=1, n_loaded=2, n_rejected=2))
    out = capsys.readouterr().out
    assert "received 7 = new 1 + read again 2 + already landed 3 + not readable 1" in out
    assert "loaded 2, rejected 2 (1 not readable), skipped 3" in out


def test_a_full_disk_under_the_reports_after_a_good_load_is_said_without_a_traceback(tmp_path):
    """The data loaded, then writing the report (and Great Expectations' Data Docs) on a full
    disk logged tracebacks; now one line says the disk is full and how to write it later."""
    disk = tmp_path / "reports"
    if not _small_disk(disk):
        pytest.skip("no tmpfs can be mounted here (needs root)")
    try:
        with (disk / "filler").open("wb") as f:  # fill it
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        inputs = tmp_path / "in"
        write(inputs / "a.json", to_api_json(good_page(1)))
        wh = tmp_path / "wh"
        proc = fh("ingest", str(inputs), "--warehouse", str(wh), "--no-progress",
                  env={"FEATUREHOUSE_REPORTS": str(disk)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "could not write the report for run" in proc.stderr and "the disk is full" in proc.stderr
        assert "featurehouse report --run run-" in proc.stderr
        assert query(wh, "SELECT count(*) FROM features") == [(1,)]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_data_folder_made_immutable_is_said_in_one_line(tmp_path):
    """EPERM ("Operation not permitted": `chattr +i`, some mounts) stops the run with its reason,
    not a traceback, as EACCES does (found from outside)."""
    wh = tmp_path / "wh"
    run_ingest([write(tmp_path / "a" / "p.json", to_api_json(good_page(1)))], Settings(warehouse=wh))
    folder = next(p for p in (wh / "data").rglob("activations") if p.is_dir())
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        write(tmp_path / "b" / "p.json", to_api_json(good_page(2)))
        proc = fh("ingest", str(tmp_path / "b"), "--warehouse", str(wh), "--no-progress")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Operation not permitted" in proc.stderr and "may not write there" in proc.stderr, proc.stderr
    assert query(Settings(warehouse=wh), "SELECT status FROM runs ORDER BY started_at DESC LIMIT 1") == [("failed",)]
