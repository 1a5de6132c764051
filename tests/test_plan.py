"""featurehouse.toml → Plan → fetch chunks (pipeline/sources/plan.py)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.sources.night import chunks, run_id_for, window_for
from pipeline.sources.plan import DEFAULT_CONFIG, ConfigError, load_plan
from tests.conftest import open_warehouse


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "featurehouse.toml"
    p.write_text(text)
    return p


def test_repo_config_loads_with_defaults():
    plan = load_plan(DEFAULT_CONFIG, env={})
    assert plan.schedule == "0 3 * * *" and plan.retry_delay == 60
    assert plan.warehouse == DEFAULT_CONFIG.parent / "warehouse"
    assert plan.inbox == DEFAULT_CONFIG.parent / "inbox"
    assert plan.base_url == "https://www.neuronpedia.org"
    assert plan.sources and all(s.model and s.source for s in plan.sources)


def test_sources_api_ranges_and_exports(tmp_path):
    path = write(tmp_path, """
[paths]
warehouse = "wh/x.duckdb"
[[sources]]
model = "m"
source = "s1"
indices = ["10:20", 5, "15:30", [40, 42], "45698"]
[[sources]]
model = "m"
source = "s2"
via = "exports"
batches = "0:3"
[[sources]]
model = "m"
source = "s3"
all = true
""")
    plan = load_plan(path, env={})
    s1, s2, s3 = plan.sources
    assert s1.ranges == ((5, 6), (10, 30), (40, 42), (45698, 45699))  # merged, sorted
    assert s1.n_indices == 1 + 20 + 2 + 1
    assert (s2.via, s2.batches) == ("exports", (0, 3))
    assert s3.all_features and s3.ranges == ()
    assert plan.warehouse == tmp_path / "wh" / "x.duckdb"


def test_env_overrides_the_file(tmp_path):
    path = write(tmp_path, '[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:10"]\n')
    env = {
        "FEATUREHOUSE_CONFIG": str(path),
        "FEATUREHOUSE_SCHEDULE": "*/5 * * * *",
        "FEATUREHOUSE_WAREHOUSE": "/data/w.duckdb",
        "FEATUREHOUSE_INBOX": "/data/inbox",
        "FEATUREHOUSE_INBOX_SETTLE_SECONDS": "0",
        "NEURONPEDIA_BASE_URL": "http://127.0.0.1:9/",
        "NEURONPEDIA_EXPORTS_URL": "http://127.0.0.1:9/bucket",
    }
    plan = load_plan(env=env)
    assert plan.config_path == path
    assert plan.schedule == "*/5 * * * *"
    assert plan.warehouse == Path("/data/w.duckdb")
    assert plan.inbox == Path("/data/inbox")
    assert plan.inbox_settle_seconds == 0
    assert plan.base_url == "http://127.0.0.1:9"
    assert plan.exports_url == "http://127.0.0.1:9/bucket"


@pytest.mark.parametrize(
    "text, message",
    [
        ('[[sources]]\nmodel = "m"\nsource = "s"\n', "give indices"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["9:3"]\n', "empty or negative"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["a:b"]\n', "not an index range"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nvia = "ftp"\n', "via must be"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nvia = "exports"\nindices = ["0:3"]\n', "whole source"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:3"]\nall = true\n', "not both"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:3"]\nbatches = "0:1"\n', "only apply"),
        ('[[sources]]\nsource = "s"\nindices = ["0:3"]\n', "needs a model"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindex = ["0:3"]\n', "unknown key"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = [1]\n[[sources]]\nmodel = "m"\nsource = "s"\nindices = [2]\n', "listed twice"),
        ('[schedule]\ncron = "nightly"\n', "cron"),
        ('[schedule]\nretry_delay = -1\n', r"\[schedule\] retry_delay must be a number of seconds from 0 to 86400 \(a day\), got -1"),
        ('[schedule]\ncron = "61 3 * * *"\n', r"\[schedule\] cron '61 3 \* \* \*' is not a valid cron expression"),
        ('[schedule]\ncron = "0 3 30 2 *"\n', r"\[schedule\] cron '0 3 30 2 \*' is not a valid cron expression"),
        ('[schedule]\ncron = "0 25 * * *"\n', r"\[schedule\] cron '0 25"),
        ('[schedule]\ncron = "@nightly"\n', r"\[schedule\] cron '@nightly' is not a cron expression"),
        ('[schedule]\ncron = 3\n', r"\[schedule\] cron must be a string \(five cron fields, or a preset such as @daily\), got 3"),
        ('[fetch]\nchunk_size = 0\n', "chunk_size"),
        ('[fetch]\nmax_failed_fraction = 1.5\n', r"\[fetch\] max_failed_fraction must be a number from 0 to 1"),
        ('[fetch]\nmax_failed_fraction = "half"\n', r"\[fetch\] max_failed_fraction must be"),
        ('[fetch]\ntask_retries = -1\n', r"\[fetch\] task_retries must be a whole number from 0 to 100"),
        ('[fetch]\ntask_retries = 100000000000\n', r"\[fetch\] task_retries must be a whole number from 0 to 100"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:9223372036854775809"]\n', "runs past the largest feature index"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nindices = [[0, 99999999999999999999]]\n', "index"),
        ('[fetch]\nmax_attempts = 0\n', r"\[fetch\] max_attempts must be a positive integer"),
        ('[fetsh]\nchunk_size = 10\n', "unknown section"),
        ('[[sources]\n', "not valid TOML"),
    ],
)
def test_bad_config_is_refused_with_the_file_and_entry_named(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as exc:
        load_plan(path, env={})
    assert str(path) in str(exc.value)


def test_missing_config_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="FEATUREHOUSE_CONFIG"):
        load_plan(env={"FEATUREHOUSE_CONFIG": str(tmp_path / "nope.toml")})


def test_window_and_run_id_come_from_the_data_interval_not_now():
    start = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
    assert window_for(start) == "featurehouse_nightly-20261128T030000Z"
    assert window_for(start) == window_for(start.astimezone(timezone(timedelta(hours=5))))
    assert window_for(datetime(2026, 11, 28, 3, 0)) == window_for(start)  # naive means UTC
    assert run_id_for(start, "featurehouse_inbox") == "airflow-featurehouse_inbox-20261128T030000Z"


def test_chunks_cover_every_index_once_and_carry_small_dicts(tmp_path):
    path = write(tmp_path, """
[fetch]
chunk_size = 100
[[sources]]
model = "m"
source = "a"
indices = ["0:250", "1000:1001"]
[[sources]]
model = "m"
source = "b"
via = "exports"
[[sources]]
model = "m"
source = "c"
all = true
""")
    plan = load_plan(path, env={})
    out = chunks(plan, "w1")
    api = [c for c in out if c["source"] == "a"]
    assert [(c["start"], c["stop"]) for c in api] == [(0, 100), (100, 200), (200, 250), (1000, 1001)]
    assert [c for c in out if c["source"] == "b"][0]["via"] == "exports"
    assert [c for c in out if c["source"] == "c"][0]["all"] is True
    assert all(c["window"] == "w1" and c["base_url"] == plan.base_url for c in out)
    # small for XCom: no page lists; the warehouse path (as long as the folder it names, longer
    # under pytest-xdist) is the only field that grows with the machine
    assert all(len(repr(c)) - len(c["warehouse"]) < 400 for c in out)


@settings(max_examples=60, deadline=None)
@given(
    ranges=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 200_000)), min_size=1, max_size=30),
    chunk_size=st.integers(1, 5000),
    max_map_length=st.integers(40, 2048),
    n_whole=st.integers(0, 5),
)
def test_chunks_stay_under_the_map_limit_and_cover_exactly(tmp_path_factory, ranges, chunk_size, max_map_length, n_whole):
    tmp = tmp_path_factory.mktemp("plan")
    specs = ", ".join(f'"{a}:{a + n}"' for a, n in ranges)
    text = f"[fetch]\nchunk_size = {chunk_size}\n[[sources]]\nmodel = \"m\"\nsource = \"s\"\nindices = [{specs}]\n"
    text += "".join(f'[[sources]]\nmodel = "m"\nsource = "x{i}"\nvia = "exports"\n' for i in range(n_whole))
    plan = load_plan(write(tmp, text), env={})
    out = chunks(plan, "w", max_map_length=max_map_length)
    assert len(out) <= max_map_length
    covered = [i for c in out if c["via"] == "api" for i in (c["start"], c["stop"])]
    got = sorted((c["start"], c["stop"]) for c in out if c["via"] == "api")
    # consecutive, non-overlapping, and exactly the merged ranges
    flat: list[tuple[int, int]] = []
    for a, b in got:
        if flat and flat[-1][1] == a:
            flat[-1] = (flat[-1][0], b)
        else:
            flat.append((a, b))
    assert tuple(flat) == plan.sources[0].ranges
    assert covered and sum(1 for c in out if c["via"] == "exports") == n_whole


def test_too_many_ranges_for_the_map_limit_is_a_config_error(tmp_path):
    specs = ", ".join(str(i * 10) for i in range(50))
    plan = load_plan(write(tmp_path, f'[[sources]]\nmodel = "m"\nsource = "s"\nindices = [{specs}]\n'), env={})
    assert len(chunks(plan, "w", max_map_length=50)) == 50
    with pytest.raises(ConfigError, match="max_map_length"):
        chunks(plan, "w", max_map_length=49)


def test_fetch_chunk_lands_each_kind_of_chunk_from_a_real_server(tmp_path):
    """The dispatcher the nightly DAG's mapped task calls: API ranges, all features, exports."""
    from pipeline.config import Settings
    from pipeline.sources.fetch import ingest_fetched
    from pipeline.sources.night import fetch_chunk
    from tests.fake_neuronpedia import MODEL, SOURCE, FakeNeuronpedia, feature_path, small_pages

    settings = Settings(warehouse=tmp_path / "wh" / "f.duckdb")
    with FakeNeuronpedia(pages=small_pages(range(30)), batch_features=8) as fake:
        (tmp_path / "fh.toml").write_text(
            f'[fetch]\nchunk_size = 10\n[neuronpedia]\nbase_url = "{fake.base_url}"\nexports_url = "{fake.exports_url}"\n'
            f'[[sources]]\nmodel = "{MODEL}"\nsource = "{SOURCE}"\nindices = ["0:12"]\n')
        api = chunks(load_plan(tmp_path / "fh.toml", env={}), "w-api")
        assert [(c["start"], c["stop"]) for c in api] == [(0, 10), (10, 12)]
        results = [fetch_chunk(c, settings) for c in api]
        assert [r["n_landed"] for r in results] == [10, 2]
        assert fake.count(feature_path(11)) == 1 and fake.count(feature_path(12)) == 0
        again = fetch_chunk(api[0], settings)  # a retried task: resumes, refetches nothing
        assert again["n_skipped_already_landed"] == 10 and fake.count(feature_path(0)) == 1

        base = {"model": MODEL, "source": SOURCE, "base_url": fake.base_url, "exports_url": fake.exports_url,
                "concurrency": 2, "requests_per_hour": 100_000}
        every = fetch_chunk(base | {"via": "api", "all": True, "window": "w-all"}, settings)
        bulk = fetch_chunk(base | {"via": "exports", "batches": None, "window": "w-exports"}, settings)
        assert every["n_failed"] == bulk["n_failed"] == 0 and bulk["n_landed"] > 0

    summary = ingest_fetched("w-api", settings, run_id="r1", progress=False)
    assert summary.n_features == 12
    # features-offset answers 25 pages per body: other bytes, so every feature loads (upserted)
    assert ingest_fetched("w-all", settings, run_id="r2", progress=False).n_features == 30
    assert ingest_fetched("w-exports", settings, run_id="r3", progress=False).status == "succeeded"

    with open_warehouse(settings.warehouse) as conn:
        assert conn.execute("SELECT count(*) FROM features").fetchone()[0] == 30


def test_parallel_fetch_tasks_share_one_nightly_rate_budget(tmp_path):
    """Neuronpedia limits requests per IP: the chunks that run at once take their requests from
    one shared bucket (tests/test_fetch_budget.py), each may use all of it; without the shared
    bucket they split the budget."""
    (tmp_path / "fh.toml").write_text(
        '[fetch]\nchunk_size = 10\nrequests_per_hour = 20000\n'
        '[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:100"]\n')
    default = chunks(load_plan(tmp_path / "fh.toml", env={}), "w")
    assert {c["requests_per_hour"] for c in default} == {20000}
    off = {"FEATUREHOUSE_FETCH_BUDGET": "off"}
    split = chunks(load_plan(tmp_path / "fh.toml", env=off), "w")
    assert {c["requests_per_hour"] for c in split} == {5000}  # 4 fetch tasks at once
    two = chunks(load_plan(tmp_path / "fh.toml", env=off | {"FEATUREHOUSE_API_SLOTS": "2"}), "w")
    assert {c["requests_per_hour"] for c in two} == {10000}


@pytest.mark.parametrize("cron", ["0 3 * * *", "*/5 * * * *", "30 2 * * mon-fri", "@daily", "@hourly", "@once"])
def test_crons_airflow_runs_are_accepted(tmp_path, cron):
    assert load_plan(write(tmp_path, f'[schedule]\ncron = "{cron}"\n'), env={}).schedule == cron


def test_a_bad_schedule_from_the_environment_is_named_as_such(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(ConfigError, match=r"FEATUREHOUSE_SCHEDULE '0 3 \* \* 8' is not a valid cron") as exc:
        load_plan(path, env={"FEATUREHOUSE_SCHEDULE": "0 3 * * 8"})
    assert str(path) in str(exc.value)


def test_fetch_failure_settings_reach_every_chunk(tmp_path):
    path = write(tmp_path, '[fetch]\nmax_failed_fraction = 0.2\nmax_attempts = 3\nbackoff = 0.5\n'
                           'task_retries = 1\ntask_retry_delay = 5\n'
                           '[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:3"]\n')
    plan = load_plan(path, env={})
    assert (plan.max_failed_fraction, plan.max_attempts, plan.backoff, plan.task_retries, plan.task_retry_delay) == (
        0.2, 3, 0.5, 1, 5.0)
    (c,) = chunks(plan, "w")
    assert (c["max_failed_fraction"], c["max_attempts"], c["backoff"]) == (0.2, 3, 0.5)
    assert load_plan(path, env={"FEATUREHOUSE_MAX_FAILED_FRACTION": "1"}).max_failed_fraction == 1.0
    with pytest.raises(ConfigError, match="FEATUREHOUSE_MAX_FAILED_FRACTION must be a number from 0 to 1"):
        load_plan(path, env={"FEATUREHOUSE_MAX_FAILED_FRACTION": "lots"})
    defaults = load_plan(write(tmp_path, ""), env={})
    assert (defaults.max_failed_fraction, defaults.max_attempts, defaults.task_retries) == (0.5, 6, 4)


# --- the whole file is checked against its schema (issue 20) ------------------------------------


@pytest.mark.parametrize(
    "text, where, key",
    [
        ('[paths]\nwarehose = "elsewhere"\n', "[paths]", "warehose"),
        ('[neuronpedia]\nbase-url = "http://127.0.0.1:9"\n', "[neuronpedia]", "base-url"),
        ('[inbox]\nsettle_secs = 5\n', "[inbox]", "settle_secs"),
        ('[schedule]\ncrn = "0 4 * * *"\n', "[schedule]", "crn"),
        ('[fetch]\nchunk_sise = 10\n', "[fetch]", "chunk_sise"),
    ],
)
def test_an_unknown_key_in_any_section_is_refused_naming_file_section_and_key(tmp_path, text, where, key):
    path = write(tmp_path, text + '[[sources]]\nmodel = "m"\nsource = "s"\nindices = [1]\n')
    with pytest.raises(ConfigError) as exc:
        load_plan(path, env={})
    msg = str(exc.value)
    assert str(path) in msg and where in msg and key in msg and "unknown key" in msg


@pytest.mark.parametrize(
    "text, entry",
    [
        ("[neuronpedia]\nbase_url = 5\n", "[neuronpedia] base_url must be an http:// or https:// URL, got 5"),
        ("[paths]\nwarehouse = 5\n", "[paths] warehouse must be a folder (a non-empty string), got 5"),
        ('[neuronpedia]\nexports_url = "neuronpedia-datasets"\n', "[neuronpedia] exports_url must be an http"),
        ('[inbox]\nsettle_seconds = "soon"\n', "[inbox] settle_seconds must be a number of seconds"),
        ('[paths]\ninbox = ["a"]\n', "[paths] inbox must be a folder"),
        ('paths = "warehouse"\n', "[paths] must be a table"),
        ('[fetch]\nconcurrency = true\n', "[fetch] concurrency must be a positive integer, got True"),
        ('sources = 3\n', "sources must be an array of tables ([[sources]]), got 3"),
        ('[[sources]]\nmodel = 5\nsource = "s"\nindices = [1]\n', "[[sources]] #1 model must be a non-empty string"),
        ('[[sources]]\nmodel = "m"\nsource = "s"\nall = "yes"\n', "[[sources]] #1 (m/s) all must be true or false"),
    ],
)
def test_a_wrong_type_is_refused_naming_file_and_entry(tmp_path, text, entry):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_plan(path, env={})
    assert str(path) in str(exc.value) and entry in str(exc.value)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("FEATUREHOUSE_INBOX_SETTLE_SECONDS", "abc", "FEATUREHOUSE_INBOX_SETTLE_SECONDS must be a number of seconds"),
        ("FEATUREHOUSE_API_SLOTS", "four", "FEATUREHOUSE_API_SLOTS must be a positive integer, got 'four'"),
        ("FEATUREHOUSE_API_SLOTS", "0", "FEATUREHOUSE_API_SLOTS must be a positive integer, got '0'"),
        ("NEURONPEDIA_BASE_URL", "www.neuronpedia.org", "NEURONPEDIA_BASE_URL must be an http:// or https:// URL"),
        ("FEATUREHOUSE_INBOX_KEEP_DAYS", "a week", "FEATUREHOUSE_INBOX_KEEP_DAYS must be a number of days"),
    ],
)
def test_a_bad_environment_value_is_refused_naming_the_variable(tmp_path, name, value, message):
    path = write(tmp_path, '[[sources]]\nmodel = "m"\nsource = "s"\nindices = [1]\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_plan(path, env={name: value})


@pytest.mark.parametrize("name, value", [("FEATUREHOUSE_LOCK_TIMEOUT", "soon"), ("FEATUREHOUSE_BATCH_BYTES", "64MB")])
def test_a_bad_setting_in_the_environment_is_refused_naming_the_variable(monkeypatch, name, value):
    from pipeline.config import BadSetting, Settings

    monkeypatch.setenv(name, value)
    with pytest.raises(BadSetting, match=f"{name} must be .*, got '{value}'"):
        Settings.from_env()


def test_a_file_without_sources_is_a_config_error_for_the_nightly(tmp_path):
    plan = load_plan(write(tmp_path, '[paths]\nwarehouse = "wh"\n'), env={})
    with pytest.raises(ConfigError, match=r"no \[\[sources\]\]") as exc:
        chunks(plan, "w")
    assert str(plan.config_path) in str(exc.value)


def test_the_inbox_reads_only_paths_and_inbox(tmp_path):
    """A mistake in a nightly source does not stop the inbox; one in [paths] or [inbox] does."""
    from pipeline.sources.plan import load_inbox_plan

    path = write(tmp_path, '[paths]\ninbox = "drop"\n[inbox]\nsettle_seconds = 5\nkeep_days = 2\n'
                           '[fetch]\nchunk_sise = 1\n[[sources]]\nmodel = "m"\nsourse = "s"\n')
    inbox = load_inbox_plan(path, env={})
    assert (inbox.inbox, inbox.warehouse, inbox.settle_seconds, inbox.keep_days) == (
        tmp_path / "drop", tmp_path / "warehouse", 5.0, 2.0)
    assert load_inbox_plan(path, env={"FEATUREHOUSE_INBOX": "/x"}).inbox == Path("/x")
    for bad, entry in [('[paths]\nwarehose = "x"\n', "[paths]: unknown key(s) warehose"),
                       ('[pahts]\ninbox = "x"\n', "unknown section(s) [pahts]"),
                       ('[inbox]\nsettle_seconds = -1\n', "[inbox] settle_seconds must be")]:
        with pytest.raises(ConfigError, match=re.escape(entry)):
            load_inbox_plan(write(tmp_path, bad), env={})
    with pytest.raises(ConfigError, match="FEATUREHOUSE_INBOX_SETTLE_SECONDS"):
        load_inbox_plan(write(tmp_path, ""), env={"FEATUREHOUSE_INBOX_SETTLE_SECONDS": "abc"})


def test_the_schema_is_valid_and_the_repo_config_lists_every_key():
    """The schema is the one description of the file: the repository's featurehouse.toml shows
    every key it allows (set, or in a comment)."""
    import json

    import jsonschema

    from pipeline.config import SCHEMAS_DIR

    schema = json.loads((SCHEMAS_DIR / "featurehouse.toml.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    text = DEFAULT_CONFIG.read_text()
    for section, sub in schema["properties"].items():
        assert f"[{section}]" in text, section
        keys = sub.get("properties") or schema["$defs"]["source"]["properties"]
        for key in keys:
            assert re.search(rf"^#? ?{key} = ", text, re.M), f"{section}.{key} is not shown in featurehouse.toml"


def test_a_manual_runs_params_name_the_one_source_it_fetches(tmp_path):
    from pipeline.sources.plan import with_params

    (tmp_path / "fh.toml").write_text('[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:5"]\n')
    planned = load_plan(tmp_path / "fh.toml", env={})
    assert with_params(planned, {"model": None, "source": "", "via": "api"}) is planned  # nothing named
    one = with_params(planned, {"model": "gpt-oss-20b", "source": "11-resid-post-aa", "indices": "3:6, 9"})
    assert [(s.model, s.source, s.ranges) for s in one.sources] == [("gpt-oss-20b", "11-resid-post-aa", ((3, 6), (9, 10)))]
    assert with_params(planned, {"model": "a", "source": "b"}).sources[0].all_features
    assert with_params(planned, {"model": "a", "source": "b", "via": "exports"}).sources[0].via == "exports"
    for bad, says in (({"model": "a"}, "no source"), ({"model": "a", "source": "b", "indices": "x"}, "params"),
                      ({"model": "a", "source": "b", "via": "ftp"}, "api or exports")):
        with pytest.raises(ConfigError, match=says):
            with_params(planned, bad)
