"""Materialise: the stats tables, computed here independently in Python from the page itself."""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import datetime, timedelta, timezone

import pytest

from pipeline.config import Settings
from pipeline.lake.warehouse import connect
from pipeline.stages.materialise import refresh
from tests.conftest import good_page, query, run_ingest, seed_page_copy, write
from tests.formats import to_api_json, to_flight

KEY = ("gpt-oss-20b", "11-resid-post-aa")


def _page_with_null_source() -> dict:
    page = seed_page_copy()
    for a in [a for a in page["activations"] if a["dataSource"] == "Chat"][:5]:
        a["dataSource"] = None
    return page


def expected_feature_stats(page: dict) -> dict:
    groups = defaultdict(list)
    for a in page["activations"]:
        if len(a["tokens"]) == len(a["values"]):  # the mismatched one is quarantined
            groups[a["dataSource"]].append(a)
    out = {}
    for ds, acts in groups.items():
        active = [v for a in acts for v in a["values"] if v > 0]
        n_tokens = sum(len(a["tokens"]) for a in acts)
        best: dict[str, float] = {}
        for a in acts:
            for t, v in zip(a["tokens"], a["values"], strict=True):
                if v > 0:
                    best[t] = max(best.get(t, v), v)
        top = sorted(best.items(), key=lambda kv: -kv[1])[:10]
        out[ds] = {
            "n_examples": len(acts), "n_tokens": n_tokens, "n_active_tokens": len(active),
            "active_token_fraction": len(active) / n_tokens,
            "max_activation": max(a["maxValue"] for a in acts),
            "mean_max_activation": statistics.fmean(a["maxValue"] for a in acts),
            "mean_active_activation": statistics.fmean(active) if active else None,
            "top": top, "best": best,
        }
    return out


def _load(root) -> tuple[Settings, dict]:
    settings = Settings(warehouse=root / "wh")
    page = _page_with_null_source()
    other = good_page(7)
    run_ingest([write(root / "in" / "a.txt", to_flight(page)), write(root / "in" / "b.json", to_api_json(other))], settings)
    return settings, {45698: expected_feature_stats(page), 7: expected_feature_stats(other)}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    settings, expected = _load(tmp_path_factory.mktemp("materialise"))
    return settings.warehouse, expected


COLS = ["n_examples", "n_tokens", "n_active_tokens", "active_token_fraction", "max_activation",
        "mean_max_activation", "mean_active_activation"]


@pytest.mark.parametrize(("index", "data_source"), [(45698, "Chat"), (45698, "Non-Chat"), (45698, None),
                                                    (7, "Chat"), (7, "Non-Chat"), (7, None)])
def test_feature_activation_stats(loaded, index, data_source):
    wh, expected = loaded
    exp = expected[index][data_source]
    rows = query(wh, f"SELECT {', '.join(COLS)}, top_tokens FROM feature_activation_stats "
                     "WHERE model_id = ? AND source_id = ? AND feature_index = ? AND data_source IS NOT DISTINCT FROM ?",
                 [*KEY, index, data_source])
    assert len(rows) == 1
    row = dict(zip([*COLS, "top_tokens"], rows[0], strict=True))
    for c in ("n_examples", "n_tokens", "n_active_tokens"):
        assert row[c] == exp[c], c
    for c in ("active_token_fraction", "max_activation", "mean_max_activation", "mean_active_activation"):
        assert row[c] == pytest.approx(exp[c], rel=1e-12), c
    top = [(t["token"], t["activation"]) for t in row["top_tokens"]]
    assert [v for _, v in top] == [v for _, v in exp["top"]]  # ordered by activation, highest first
    assert all(exp["best"][t] == v for t, v in top)  # each token at its own highest activation
    assert len({t for t, _ in top}) == len(top)


def test_one_row_per_feature_and_data_source(loaded):
    wh, expected = loaded
    assert query(wh, "SELECT count(*) FROM feature_activation_stats") == [(sum(len(e) for e in expected.values()),)]
    assert query(wh, "SELECT count(*) FROM feature_activation_stats WHERE data_source IS NULL") == [(2,)]


@pytest.mark.parametrize("data_source", ["Chat", "Non-Chat", None])
def test_source_activation_stats(loaded, data_source):
    wh, expected = loaded
    feats = [e[data_source] for e in expected.values() if data_source in e]
    n_active = sum(f["n_active_tokens"] for f in feats)
    exp = {
        "n_features": len(feats), "n_examples": sum(f["n_examples"] for f in feats),
        "n_tokens": sum(f["n_tokens"] for f in feats), "n_active_tokens": n_active,
        "max_activation": max(f["max_activation"] for f in feats),
        "mean_feature_max_activation": statistics.fmean(f["max_activation"] for f in feats),
        "median_feature_max_activation": statistics.median(f["max_activation"] for f in feats),
        "mean_active_activation": sum(f["mean_active_activation"] * f["n_active_tokens"] for f in feats) / n_active,
    }
    cols = list(exp)
    rows = query(wh, f"SELECT {', '.join(cols)} FROM source_activation_stats WHERE model_id = ? AND source_id = ? "
                     "AND data_source IS NOT DISTINCT FROM ?", [*KEY, data_source])
    assert len(rows) == 1
    for c, v in zip(cols, rows[0], strict=True):
        assert v == pytest.approx(exp[c], rel=1e-12), c


def test_refresh_only_touches_changed_features_and_mends_a_crash(tmp_path):
    settings, _ = _load(tmp_path)
    with connect(settings) as conn:
        before = conn.execute("SELECT * EXCLUDE (refreshed_at) FROM feature_activation_stats ORDER BY ALL").fetchall()
        conn.execute("DELETE FROM feature_activation_stats")  # as if a run crashed before materialising
        conn.execute("DELETE FROM source_activation_stats")
        r = refresh(conn, settings)  # all features
        assert (r.n_features, r.n_sources, r.feature_stats_rows) == (2, 1, 6)
        assert r.source_stats_rows == conn.execute("SELECT count(*) FROM source_activation_stats").fetchone()[0] > 0
        after = conn.execute("SELECT * EXCLUDE (refreshed_at) FROM feature_activation_stats ORDER BY ALL").fetchall()
        assert after == before
        r = refresh(conn, settings, "no-such-run")
        assert (r.n_features, r.feature_stats_rows) == (0, 0)
        assert conn.execute("SELECT count(*) FROM feature_activation_stats").fetchone() == (6,)


def test_refresh_of_a_run_finds_every_feature_it_changed_even_when_a_later_run_reloaded_them(tmp_path):
    """materialise --run-id took "the features whose rows name the run" and missed those a later
    run reloaded; it now reads the run's own snapshots."""
    settings, _ = _load(tmp_path)
    (first,) = query(settings.warehouse, "SELECT run_id FROM runs")[0]
    newer = good_page(7)
    newer["activations"] = newer["activations"][:1]
    run_ingest([write(tmp_path / "in2" / "b.json", to_api_json(newer))], settings)
    with connect(settings) as conn:
        conn.execute("DELETE FROM feature_activation_stats")
        r = refresh(conn, settings, first)
        assert r.n_features == 2, "both features the first run loaded, though feature 7 was reloaded since"
        assert conn.execute("SELECT sum(n_examples) FROM feature_activation_stats WHERE feature_index = 7").fetchone() == (1,)


def test_refreshed_at_is_utc_whatever_the_machine_time_zone(tmp_path):
    """README: timestamps are UTC. A warehouse written on a machine in Tokyo must say so too."""
    settings, _ = _load(tmp_path)
    with connect(settings) as conn:
        conn.execute("SET TimeZone = 'Asia/Tokyo'")
        refresh(conn, settings)
        stamps = conn.execute("SELECT refreshed_at FROM feature_activation_stats UNION ALL "
                              "SELECT refreshed_at FROM source_activation_stats").fetchall()
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    for (ts,) in stamps:
        assert abs(ts - now) < timedelta(minutes=5), f"refreshed_at {ts} is not UTC now ({now})"


def test_stats_refreshed_in_feature_chunks_equal_one_pass(tmp_path, monkeypatch):
    """Stats are computed STATS_CHUNK_FEATURES features at a time (a whole 1 GiB export batch in
    one statement ran out of DuckDB's memory); chunks change no figure, in a load or a refresh."""
    import orjson

    from bench.generate import synthetic_page
    from pipeline.stages import materialise

    files = [write(tmp_path / "in" / f"{i}.json", orjson.dumps(synthetic_page(i))) for i in range(7)]
    stats = "SELECT * EXCLUDE (refreshed_at) FROM feature_activation_stats ORDER BY ALL"
    one = Settings(warehouse=tmp_path / "one")
    run_ingest(files, one)
    monkeypatch.setattr(materialise, "STATS_CHUNK_FEATURES", 2)
    chunked = Settings(warehouse=tmp_path / "chunked")
    run_ingest(files, chunked)
    assert query(chunked, stats) == query(one, stats) and len(query(one, stats)) >= 7
    with connect(chunked) as conn:
        assert refresh(conn, chunked).n_features == 7
    assert query(chunked, stats) == query(one, stats)


def test_a_refresh_that_changes_nothing_commits_nothing(tmp_path):
    """Issue 45: `materialise` on an unchanged warehouse committed identical rows as a new
    snapshot, and every find command then said the index was stale."""
    settings, _ = _load(tmp_path)
    with connect(settings) as conn:
        def snapshots() -> int:
            return conn.execute("SELECT count(*) FROM featurehouse.snapshots()").fetchone()[0]

        n = snapshots()
        r = refresh(conn, settings)
        assert (r.n_features, r.n_sources, r.feature_stats_rows) == (2, 1, 6) and r.source_stats_rows > 0
        assert r.unchanged and snapshots() == n, "a refresh that changed nothing made a snapshot"
        conn.execute("UPDATE feature_activation_stats SET max_activation = -1 WHERE feature_index = 7")
        n = snapshots()
        assert not refresh(conn, settings).unchanged
        assert snapshots() == n + 1
        assert conn.execute("SELECT min(max_activation) FROM feature_activation_stats").fetchone()[0] > 0


def test_the_command_says_when_the_statistics_were_already_as_computed(tmp_path):
    """Review: `featurehouse materialise` said "refreshed 202 feature stats rows" when nothing
    changed and nothing was committed."""
    import subprocess
    import sys
    from pathlib import Path

    settings, _ = _load(tmp_path)
    fh = [str(Path(sys.executable).parent / "featurehouse"), "materialise", "--warehouse", str(settings.warehouse)]
    same = subprocess.run(fh, capture_output=True, text=True)
    assert same.returncode == 0 and same.stdout.startswith("unchanged: the 6 feature stats rows over 2 features"), same
    assert "nothing committed" in same.stdout and "refreshed" not in same.stdout
    with connect(settings) as conn:
        conn.execute("UPDATE feature_activation_stats SET max_activation = -1 WHERE feature_index = 7")
    changed = subprocess.run(fh, capture_output=True, text=True)
    assert changed.returncode == 0 and changed.stdout.startswith("refreshed 6 feature stats rows over 2 features"), changed
