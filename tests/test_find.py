"""Finding features offline (pipeline.outputs.find): search, similar, by-token, show, and the
derived index beside the warehouse — against a real warehouse loaded from a synthetic export
shaped like the real one, answers checked against brute force over the warehouse itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.find_source import MODEL, SOURCE, TOPICS, write_source
from pipeline.config import Settings
from pipeline.outputs import find
from pipeline.outputs.find import card
from tests.conftest import good_page, query, run_ingest, write
from tests.formats import to_api_json

FEATUREHOUSE = Path(sys.executable).parent / "featurehouse"
N_FEATURES = 1200


def _unit(seed: int) -> list[float]:
    v = np.random.default_rng(seed).normal(size=256)
    return [round(x, 9) for x in (v / np.linalg.norm(v)).tolist()]


def _page_two_explanations() -> dict:
    """A feature of another model with two explanations (one embedding a string): its
    similarity is the best of its pairs."""
    page = good_page(7)
    page["explanations"] = [
        {"id": "exp-two-a", "description": "jokes told by comedians", "explanationModelName": "gpt-4o-mini",
         "typeName": "np_max-act", "scores": [], "embedding": _unit(1)},
        {"id": "exp-two-b", "description": "a second view: CPU things", "explanationModelName": "gemini-2.0-flash",
         "typeName": "np_max-act", "scores": [], "embedding": json.dumps(_unit(2))},
    ]
    return page


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    root = tmp_path_factory.mktemp("find")
    write_source(root / "src", N_FEATURES, 120, seed=3, batch=600, excerpts=4, tokens=24)
    write(root / "pages" / "two.json", to_api_json(_page_two_explanations()))
    write(root / "pages" / "plain.json", to_api_json(good_page(8)))  # no embedding: the token basis
    settings = Settings(warehouse=root / "wh")
    run_ingest([root / "src", root / "pages"], settings)
    info = find.build_index(settings)
    return settings, info


@pytest.fixture(scope="module")
def finder(lake):
    with find.Finder(lake[0]) as f:
        yield f


def _brute_force(settings: Settings, key: tuple[str, str, int], source: str | None = None) -> list[tuple]:
    """Every feature's best cosine with the query feature's embeddings, from the warehouse's
    values: float64, no index."""
    rows = query(settings, "SELECT model_id, source_id, feature_index, embedding FROM explanations "
                           "WHERE embedding IS NOT NULL")
    mine = np.array([e for m, s, i, e in rows if (m, s, i) == key])
    best: dict[tuple, float] = {}
    for m, s, i, e in rows:
        if (m, s, i) == key or (source and s != source):
            continue
        v = np.array(e)
        cos = float(max(mine @ v / (np.linalg.norm(mine, axis=1) * np.linalg.norm(v))))
        best[(m, s, i)] = max(best.get((m, s, i), -2.0), cos)
    return sorted(best.items(), key=lambda kv: -kv[1])


def test_the_index_holds_the_warehouse(lake):
    settings, info = lake
    assert info.mode == "built"
    assert info.n_explanations == N_FEATURES + 3 and info.n_embeddings == N_FEATURES + 2
    (n_string,) = query(settings, "SELECT count(*) FROM explanations WHERE explanation_model IN "
                                  "('gemini-2.0-flash', 'gpt-4.1-nano') AND embedding IS NOT NULL")[0]
    assert n_string > N_FEATURES // 3  # both encodings loaded as numbers


@pytest.mark.parametrize("index", [0, 17, 999])
def test_similar_is_exactly_brute_force(lake, finder, index):
    settings, _ = lake
    key = (MODEL, SOURCE, index)
    expected = _brute_force(settings, key)[:10]
    got = finder.similar(f"{MODEL}/{SOURCE}/{index}", limit=10)
    assert [(m, s, i) for m, s, i, *_ in got.rows] == [k for k, _ in expected]
    assert [round(r[3], 6) for r in got.rows] == [round(c, 6) for _, c in expected]
    assert {r[4] for r in got.rows} == {"embedding"}
    # neighbours share the topic the generator put them near
    topic = TOPICS[(index * 7919) % len(TOPICS)][0]
    assert sum(topic in r[5] for r in got.rows) >= 8


def test_similar_best_pair_across_models_and_narrowed(lake, finder):
    settings, _ = lake
    key = ("gpt-oss-20b", "11-resid-post-aa", 7)
    expected = _brute_force(settings, key)[:5]
    got = finder.similar("gpt-oss-20b/11-resid-post-aa/7", limit=5)
    assert [(m, s, i) for m, s, i, *_ in got.rows] == [k for k, _ in expected]
    narrowed = finder.similar(f"{MODEL}/{SOURCE}/5", source="11-resid-post-aa", limit=5)
    assert [(r[0], r[2]) for r in narrowed.rows] == [("gpt-oss-20b", 7)]


def test_similar_without_an_embedding_uses_tokens(finder):
    got = finder.similar("gpt-oss-20b/11-resid-post-aa/8", limit=5)
    assert got.rows and {r[4] for r in got.rows} == {"tokens"}
    # page 7 has the same top tokens and logits as page 8 (good_page): the closest
    assert (got.rows[0][0], got.rows[0][2], got.rows[0][3]) == ("gpt-oss-20b", 7, 1.0)
    with pytest.raises(find.NoSuchFeature):
        finder.similar("gpt-oss-20b/11-resid-post-aa/123456")


def test_search_is_the_fts_extensions_bm25(finder):
    for q in ["jokes", "Paris France", "programming syntax"]:
        got = finder.search(q, limit=N_FEATURES + 10)
        macro = dict(finder.conn.execute(
            "SELECT doc_id, score FROM (SELECT doc_id, fts_main_docs.match_bm25(doc_id, ?) AS score FROM docs) "
            "WHERE score IS NOT NULL", [q]).fetchall())
        assert len(got.rows) == len(macro) > 0
        assert sorted(round(r[5], 4) for r in got.rows) == sorted(round(v, 4) for v in macro.values())
        scores = [r[5] for r in got.rows]
        assert scores == sorted(scores, reverse=True)


def test_search_stems_phrases_and_narrows(finder):
    stemmed = finder.search("joking", limit=5)  # porter: joking → joke
    assert stemmed.rows and all("joke" in r[3].lower() for r in stemmed.rows)
    phrase = finder.search('"comedians" jokes', limit=50)
    assert [(r[0], r[2]) for r in phrase.rows] == [("gpt-oss-20b", 7)]
    assert finder.search("jokes", model="gpt-oss-20b").rows[0][2] == 7
    assert finder.search("jokes", source=SOURCE, limit=3).rows[0][1] == SOURCE
    assert finder.search("qwertyuiop").rows == []


@pytest.mark.parametrize("word", ["when", "about", "from", "the"])
def test_search_finds_every_word_a_description_holds(lake, finder, word):
    """Issue 45: `search first` answered "(no match)" although descriptions hold the word: the
    index dropped the fts extension's English stop words. Each is a word like any other now."""
    got = finder.search(word, limit=N_FEATURES + 10)
    holding = [r for (r,) in query(lake[0], "SELECT count(*) FROM explanations WHERE "
                                            "list_contains(string_split(lower(description), ' '), ?)", [word])]
    assert holding[0] > 0 and len(got.rows) == holding[0]
    assert all(word in r[3].lower().split() for r in got.rows)


def _brute_by_token(settings, token: str, fold) -> list[tuple]:
    rows = query(settings, 'SELECT model_id, source_id, feature_index, tokens, "values", max_value_token_index '
                           "FROM activations")
    best: dict[tuple, list] = {}
    for m, s, i, toks, vals, peak in rows:
        for j, (t, v) in enumerate(zip(toks, vals)):
            if v > 0 and fold(t) == fold(token):
                b = best.setdefault((m, s, i), [0.0, 0])
                b[0] = max(b[0], v)
                b[1] += j == peak
    return sorted(((k, v[0], v[1]) for k, v in best.items()), key=lambda r: (-r[1], -r[2], r[0]))


@pytest.mark.parametrize(("token", "kw", "fold"), [
    (" Paris", {}, lambda t: t),
    ("paris", {"ignore_case": True, "strip": True}, lambda t: t.lstrip(" ▁Ġ").lower()),
    ("CPU", {"strip": True}, lambda t: t.lstrip(" ▁Ġ")),
])
def test_by_token_is_exact(lake, finder, token, kw, fold):
    settings, _ = lake
    expected = _brute_by_token(settings, token, fold)
    got = finder.by_token(token, limit=1000, **kw)
    assert len(expected) >= 3
    assert [((r[0], r[1], r[2]), r[3], r[4]) for r in got.rows] == expected


def test_by_token_data_source(finder):
    got = finder.by_token("t0_2", data_source="Chat")
    assert [(r[0], r[2], r[3], r[4]) for r in got.rows] == [("gpt-oss-20b", 7, 3.25, 1), ("gpt-oss-20b", 8, 3.25, 1)]
    assert finder.by_token("t0_2", data_source="Non-Chat").rows == []


def test_refresh_after_a_load_and_stale_note(tmp_path, lake):
    # a copy of the warehouse, so the module's stays as built
    import shutil

    src_settings, _ = lake
    wh = tmp_path / "wh"
    shutil.copytree(src_settings.warehouse, wh)
    settings = Settings(warehouse=wh)
    old = find.Finder(settings)
    assert old.note is None
    page = good_page(9, model="other-model", source="3-res")
    page["explanations"][0].update(description="penguins on ice", embedding=_unit(9))
    # and a feature already indexed, captured again: its old explanation leaves the index
    again = good_page(5, model=MODEL, source=SOURCE)
    again["explanations"][0].update(description="jokes about penguins", embedding=_unit(5))
    run_ingest([write(tmp_path / "in" / "p.json", to_api_json(page)),
                write(tmp_path / "in" / "again.json", to_api_json(again))], settings)
    with find.Finder(settings) as stale:
        assert "changed since" in stale.note and stale.search("penguins").rows == []
    info = find.refresh_index(settings)
    assert info.mode == "refreshed" and info.n_changed_features == 2
    with find.Finder(settings) as fresh:
        assert fresh.note is None
        assert sorted((r[0], r[2]) for r in fresh.search("penguins").rows) == [(MODEL, 5), ("other-model", 9)]
        assert [r[3] for r in fresh.search("jokes", source=SOURCE, limit=5000).rows if r[2] == 5] == [
            "jokes about penguins"]
        assert fresh.similar("other-model/3-res/9", limit=3).rows[0][4] == "embedding"
        refreshed = [fresh.similar(f"{MODEL}/{SOURCE}/{i}", limit=8).rows for i in (0, 5)]
        searched = fresh.search("jokes humour", limit=20).rows
        tokens = fresh.by_token("t1_0", limit=20).rows
    # the old index, opened before, still answers whole (the file was replaced, not rewritten)
    assert old.search("jokes", limit=3).rows and old.similar(f"{MODEL}/{SOURCE}/0", limit=3).rows
    old.close()
    # a refresh gives what a build from scratch gives
    assert find.build_index(settings).mode == "built"
    with find.Finder(settings) as built:
        assert [built.similar(f"{MODEL}/{SOURCE}/{i}", limit=8).rows for i in (0, 5)] == refreshed
        assert built.search("jokes humour", limit=20).rows == searched
        assert built.by_token("t1_0", limit=20).rows == tokens
    assert find.refresh_index(settings).mode == "current"


def _strongest_excerpts(settings: Settings) -> dict[tuple, dict]:
    """Each feature's strongest excerpt from the warehouse itself, in Python: the activation of
    the largest max_value (ties: the smaller id), EXCERPT_CONTEXT tokens each side of its peak."""
    c = find.EXCERPT_CONTEXT
    best: dict[tuple, tuple] = {}
    for m, s, i, aid, mx, at, ds, toks, vals in query(settings, """
            SELECT model_id, source_id, feature_index, activation_id, max_value, max_value_token_index,
                   data_source, tokens, "values" FROM activations"""):
        rank = (mx if mx is not None else float("-inf"), _neg(aid))
        if (m, s, i) not in best or rank > best[(m, s, i)][0]:
            best[(m, s, i)] = (rank, mx, at, ds, toks, vals)
    out = {}
    for key, (_, mx, at, ds, toks, vals) in best.items():
        start = max(at - c, 0)
        out[key] = {"data_source": ds, "max_value": mx, "peak": at - start, "tokens": toks[start:at + c + 1],
                    "values": vals[start:at + c + 1]}
    return out


def _neg(s: str) -> tuple:
    """A key that sorts strings the other way round (the smaller id wins a tie)."""
    return tuple(-ord(ch) for ch in s) + (1,)


def test_the_index_keeps_each_features_strongest_excerpt(lake, finder, tmp_path):
    """Issue 43: search and by-token show each result's strongest excerpt from the find index
    (reading the lake's activations for them took ~100 ms a page at 262k): the index's excerpt is
    the warehouse's, computed here in Python; a feature without excerpts has none; after a load
    that gives a feature a stronger excerpt, a refresh shows the new one, as a build does."""
    import shutil

    settings, _ = lake
    want = _strongest_excerpts(settings)
    indexed = {k for k in want if finder.excerpts([k])}
    assert len(want) > 100 and indexed == set(want), len(set(want) - indexed)
    keys = sorted(want)[:25]
    assert finder.excerpts(keys) == {k: want[k] for k in keys}
    none = (MODEL, SOURCE, N_FEATURES + 50)  # no such feature
    assert finder.excerpts([none, keys[0]]) == {keys[0]: want[keys[0]]}
    assert finder.excerpts([]) == {}

    wh = tmp_path / "wh"
    shutil.copytree(settings.warehouse, wh)
    copy = Settings(warehouse=wh)
    page = good_page(3, model=MODEL, source=SOURCE)  # a feature the source holds, captured again
    page["activations"][0].update(tokens=["a", " b", "c"], values=[0.0, 9999.0, 1.0], maxValue=9999.0,
                                  maxValueTokenIndex=1, minValue=0.0)
    run_ingest([write(tmp_path / "in" / "p.json", to_api_json(page))], copy)
    assert find.refresh_index(copy).mode == "refreshed"
    now = _strongest_excerpts(copy)
    key = (MODEL, SOURCE, 3)
    assert now[key]["max_value"] == 9999.0 and now[key]["tokens"] == ["a", " b", "c"] and now[key]["peak"] == 1
    with find.Finder(copy) as fresh:
        assert fresh.excerpts([key, keys[1]]) == {key: now[key], keys[1]: now[keys[1]]}
    find.build_index(copy)
    with find.Finder(copy) as built:
        assert built.excerpts(sorted(now)[:40] + [key]) == {k: now[k] for k in sorted(now)[:40] + [key]}


def _fh(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_cli_find_commands(lake, tmp_path):
    settings, _ = lake
    wh = str(settings.warehouse)
    r = _fh("search", "jokes", "--warehouse", wh, "--format", "json", "-n", "3")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 3 and {"model_id", "source_id", "feature_index", "description", "explanation_model",
                               "score", "max_activation"} <= set(rows[0])
    r = _fh("similar", f"{MODEL}/{SOURCE}/17", "--warehouse", wh, "--format", "csv", "-n", "4")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "model_id,source_id,feature_index,similarity,basis,description"
    assert len(r.stdout.splitlines()) == 5
    r = _fh("by-token", "paris", "--ignore-case", "--strip", "--warehouse", wh)
    assert r.returncode == 0 and "Paris" in r.stdout
    r = _fh("similar", "not-a-key", "--warehouse", wh)
    assert r.returncode == 2 and "MODEL/SOURCE/INDEX" in r.stderr
    html = tmp_path / "f.html"
    r = _fh("show", "gpt-oss-20b/11-resid-post-aa/7", "--warehouse", wh, "--html", str(html))
    assert r.returncode == 0, r.stderr
    assert "[[t0_2]]" in r.stdout and "jokes told by comedians" in r.stdout and "nearest features" in r.stdout
    assert html.exists()
    r = _fh("show", "gpt-oss-20b/11-resid-post-aa/7", "--warehouse", wh, "--excerpts", "0")  # no heading over nothing
    assert r.returncode == 0 and "top excerpts (the peak token in [[ ]]):\n  (none)\nnearest features:" in r.stdout, r.stdout


def test_cli_find_path_imports_nothing_heavy(lake):
    settings, _ = lake
    code = ("import sys\nfrom pipeline.cli import cli\n"
            "try:\n    cli(['search', 'jokes', '--warehouse', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('great_expectations', 'pandas', 'pipeline.ingest', 'altair') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    r = subprocess.run([sys.executable, "-c", code, str(settings.warehouse)], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout, r.stdout + r.stderr


def test_pipeline_ingest_stays_the_function_after_its_module_is_imported():
    # the lazy package: importing the submodule pipeline.ingest must not shadow the function
    code = ("import pipeline.ingest, pipeline.stages.materialise\nfrom pipeline import ingest, refresh_stats\n"
            "import pipeline\nprint(callable(ingest), type(ingest).__name__, pipeline.ingest is ingest,\n"
            "      pipeline.refresh_stats.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["True", "function", "True", "refresh"], r.stdout + r.stderr


def test_find_from_python_returns_arrow(lake):
    import pipeline

    settings, _ = lake
    got = pipeline.search(settings, "jokes", limit=4)
    table = got.to_arrow()
    assert table.num_rows == 4 and table.column_names[:3] == ["model_id", "source_id", "feature_index"]
    assert pipeline.by_token(settings, "paris", ignore_case=True, strip=True).as_dicts()[0]["n_active"] >= 1


def test_a_missing_index_is_named(tmp_path):
    settings = Settings(warehouse=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        find.Finder(settings)


@pytest.mark.browser
def test_show_html_renders_in_chromium(lake, tmp_path):
    from tests.test_report import CHROMIUM, Browser

    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium")
    settings, _ = lake
    view = find.show(settings, "gpt-oss-20b/11-resid-post-aa/7")
    page = tmp_path / "feature.html"
    page.write_text(find.render_html(view), encoding="utf-8")
    b = Browser()
    try:
        b.open(page.as_uri())
        assert b.problems() == []
        assert b.js("document.title").startswith("gpt-oss-20b/11-resid-post-aa/7")
        # self-contained: nothing to fetch, no script
        assert b.js("document.querySelectorAll('script, link, img, iframe').length") == 0
        excerpts = b.js("""[...document.querySelectorAll('.excerpt')].map(e => ({
            max: parseFloat(e.dataset.max),
            toks: [...e.querySelectorAll('.tok')].map(t => ({v: parseFloat(t.dataset.activation),
                   bg: getComputedStyle(t).backgroundColor, peak: t.classList.contains('peak'),
                   outline: getComputedStyle(t).outlineStyle, text: t.textContent}))}))""")
        assert len(excerpts) == 3
        top = max(e["max"] for e in excerpts)
        for e in excerpts:
            peaks = [t for t in e["toks"] if t["peak"]]
            assert len(peaks) == 1 and peaks[0]["v"] == e["max"] and peaks[0]["outline"] == "solid"
            for t in e["toks"]:  # shaded by activation: the alpha is the value over the largest
                alpha = float(t["bg"].rstrip(")").split(",")[3]) if t["bg"].startswith("rgba") else 1.0
                if t["v"] == 0:
                    assert t["bg"] in ("rgba(255, 120, 0, 0)", "rgba(0, 0, 0, 0)")
                else:
                    assert alpha == pytest.approx(t["v"] / top, abs=0.002)
        assert b.js("document.querySelector('.explanations').textContent").count("jokes told by comedians") == 1
        assert b.js("document.querySelectorAll('table.neighbours tr').length") > 1
        b.screenshot(tmp_path / "feature.png")
    finally:
        b.close()


# --- review of issue 19: the index's freshness, identity, damage, permissions, bad input -------


def _copy(lake, tmp_path: Path, **kw) -> Settings:
    """A copy of the module's warehouse (and its find index), to change without touching it."""
    import shutil

    wh = tmp_path / "wh"
    shutil.copytree(lake[0].warehouse, wh)
    return Settings(warehouse=wh, **kw)


@pytest.fixture(scope="module")
def other_lake(tmp_path_factory):
    """Another warehouse: one page whose description and tokens hold terminal escapes."""
    root = tmp_path_factory.mktemp("other")
    page = good_page(3, model="other-model", source="5-res")
    page["explanations"][0].update(description="penguins \x1b[31mred\x1b[0m \x1b]0;pwned\x07 here",
                                   embedding=_unit(3))
    page["activations"][0]["tokens"][0] = "\x1b[2J"
    settings = Settings(warehouse=root / "wh")
    run_ingest([write(root / "in" / "p.json", to_api_json(page))], settings)
    return settings


def test_the_index_is_stale_after_maintain_expired_the_history(lake, tmp_path):
    from datetime import timedelta

    from pipeline.lake import warehouse as warehouse_mod
    from pipeline.lake.maintain import maintain

    settings = _copy(lake, tmp_path)
    assert find.refresh_index(settings).mode == "current"
    maintain(settings, retention_days=0, grace=timedelta(0))  # nothing changed: merged files only
    assert find.refresh_index(settings).mode == "current"
    with warehouse_mod.connect(settings) as conn:
        conn.execute(f"DELETE FROM {warehouse_mod.CATALOG}.explanations WHERE feature_index = 3")
        # then a commit the index does not read, as a run's last one (its report) is
        conn.execute(f"DELETE FROM {warehouse_mod.CATALOG}.runs WHERE run_id = (SELECT max(run_id) FROM "
                     f"{warehouse_mod.CATALOG}.runs)")
    # the delete's snapshot is expired: only the change feed said it was there
    maintain(settings, retention_days=0, grace=timedelta(0))
    with find.Finder(settings) as stale:
        assert stale.note and "changed since" in stale.note
    assert find.refresh_index(settings).mode == "built"
    assert find.refresh_index(settings).mode == "current"
    with find.Finder(settings) as fresh:
        assert fresh.note is None
        assert not [r for r in fresh.search("jokes humour paris programming", limit=5000).rows if r[2] == 3]


def test_a_find_dir_two_warehouses_share_is_rebuilt_for_each(lake, other_lake, tmp_path):
    shared = tmp_path / "shared-find"
    a = _copy(lake, tmp_path, find_dir=shared)
    b = Settings(warehouse=other_lake.warehouse, find_dir=shared)
    assert find.build_index(a).mode == "built"
    with pytest.raises(find.FindIndexForeign, match="another warehouse"):
        find.Finder(b)
    assert find.index_info(b)["same_warehouse"] is False
    assert find.refresh_index(b).mode == "built"  # not "current": the snapshot ids mean nothing here
    with find.Finder(b) as f:
        assert [r[0] for r in f.search("penguins").rows] == ["other-model"]
    with pytest.raises(find.FindIndexForeign):
        find.Finder(a)
    r = _fh("search", "jokes", "--warehouse", str(a.warehouse), "-n", "1", FEATUREHOUSE_FIND_DIR=str(shared))
    assert r.returncode == 0 and "another warehouse" in r.stderr and MODEL in r.stdout, r.stderr


@pytest.mark.parametrize("damage", ["garbage", "cut_matrix", "no_matrix"])
def test_damaged_find_files_are_said_and_rebuilt(lake, tmp_path, damage):
    settings = _copy(lake, tmp_path)
    d = settings.find_index_dir
    if damage == "garbage":
        (d / "index.duckdb").write_bytes(b"\x00not a database" * 1000)
    else:
        (m,) = d.glob("emb-*.f32")
        if damage == "cut_matrix":
            with open(m, "r+b") as f:
                f.truncate(m.stat().st_size // 2)
        else:
            m.unlink()
    with pytest.raises(find.FindIndexDamaged):
        find.Finder(settings)
    r = _fh("search", "jokes", "--warehouse", str(settings.warehouse), "-n", "2")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "building the find index" in r.stderr and MODEL in r.stdout
    assert find.refresh_index(settings).mode == "current"
    with find.Finder(settings) as f:
        assert f.similar(f"{MODEL}/{SOURCE}/0", limit=2).rows


def test_index_rebuilds_damaged_files_instead_of_saying_current(lake, tmp_path):
    settings = _copy(lake, tmp_path)
    (m,) = settings.find_index_dir.glob("emb-*.f64")
    m.write_bytes(b"")
    assert find.refresh_index(settings).mode == "built"


def test_a_read_only_warehouse_answers_from_a_current_index_or_says_it_cannot_build(lake, tmp_path):
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the override of file permissions")
    as_user = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    settings = _copy(lake, tmp_path)
    wh = settings.warehouse

    def read_only(on: bool) -> None:
        for p in [wh, *wh.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222 if on else p.stat().st_mode | 0o200)

    def fh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(as_user + [str(FEATUREHOUSE), *args, "--warehouse", str(wh)],
                              capture_output=True, text=True, timeout=120)

    read_only(True)
    try:
        for args in (["search", "jokes"], ["search", "jokes", "--refresh"], ["by-token", " Paris"],
                     ["show", f"{MODEL}/{SOURCE}/0"]):
            r = fh(*args)
            assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)
        r = fh("index")
        assert r.returncode == 0 and "current" in r.stdout, r.stderr
        r = fh("index", "--full")
        assert r.returncode == 1 and "Traceback" not in r.stderr and "permission denied" in r.stderr, r.stderr
    finally:
        read_only(False)
    shutil.rmtree(settings.find_index_dir)
    read_only(True)
    try:
        r = fh("search", "jokes")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "cannot be built" in r.stderr and "permission denied" in r.stderr, r.stderr
    finally:
        read_only(False)


def test_terminal_escapes_are_printed_escaped(other_lake):
    wh = str(other_lake.warehouse)
    for args in (["search", "penguins"], ["show", "other-model/5-res/3"], ["by-token", "\x1b[2J"]):
        r = _fh(*args, "--warehouse", wh)
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "\\x1b[31mred" in _fh("search", "penguins", "--warehouse", wh).stdout


@pytest.mark.parametrize("limit", [0, -1, 2.5, "3", True, None])
def test_the_python_api_checks_limit(finder, limit):
    for call in (lambda: finder.search("jokes", limit=limit), lambda: finder.by_token("t0_2", limit=limit),
                 lambda: finder.similar(f"{MODEL}/{SOURCE}/0", limit=limit)):
        with pytest.raises(ValueError, match="limit"):
            call()


def test_an_empty_answer_has_typed_arrow_columns(finder):
    import pyarrow as pa

    empty, full = finder.search("qwertyuiop").to_arrow(), finder.search("jokes", limit=2).to_arrow()
    assert empty.num_rows == 0 and empty.schema == full.schema
    assert empty.schema.field("feature_index").type == pa.int64() and empty.schema.field("score").type == pa.float64()
    tok = finder.by_token("no-such-token").to_arrow()
    assert tok.schema == finder.by_token("t0_2").to_arrow().schema
    assert tok.schema.field("tokens").type == pa.list_(pa.string())
    sim = finder.similar(f"{MODEL}/{SOURCE}/0", limit=3).to_arrow()
    assert sim.schema.field("similarity").type == pa.float64()


def test_an_empty_search_is_a_usage_error(lake):
    with pytest.raises(ValueError, match="empty"):
        find.search(lake[0], "  ")
    r = _fh("search", "", "--warehouse", str(lake[0].warehouse))
    assert r.returncode == 2 and "empty" in r.stderr


def test_a_search_of_punctuation_alone_says_it_holds_no_word(lake):
    """Issue 45 review: `search '&'` answered "(no match)", as if no description held it; the
    index holds words only, so the query searched nothing. Said, as a usage error, on every road."""
    for text in ("&", "&& -", '"&"', "50001"):  # (digits: the full-text index drops them too)
        with pytest.raises(find.QueryHoldsNoWord, match="holds no word"):
            find.search(lake[0], text)
        r = _fh("search", text, "--warehouse", str(lake[0].warehouse))
        assert r.returncode == 2 and "holds no word" in r.stderr, r.stderr
    assert len(find.search(lake[0], "jokes & humour", limit=3)) == 3  # punctuation among words is fine


def test_a_leftover_lock_and_two_rebuilds_at_once(lake, tmp_path):
    settings = _copy(lake, tmp_path)
    (settings.find_index_dir / ".lock").write_text("left by a builder that was killed")
    procs = [subprocess.Popen([str(FEATUREHOUSE), "index", "--full", "--warehouse", str(settings.warehouse)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert find.refresh_index(settings).mode == "current"
    with find.Finder(settings) as f:
        assert len(f.search("jokes", limit=3)) == 3 and f.similar(f"{MODEL}/{SOURCE}/0", limit=3).rows


# --- outside review: diverged copies, non-warehouses, one-line errors, a long-lived Finder, html ---


def _penguins(tmp_path: Path, name: str, index: int, description: str) -> Path:
    page = good_page(index, model="other-model", source="3-res")
    page["explanations"][0].update(description=description, embedding=_unit(index))
    return write(tmp_path / f"in-{name}" / "p.json", to_api_json(page))


def test_a_diverged_copy_sharing_a_find_dir_is_rebuilt(lake, tmp_path):
    import shutil

    shared = tmp_path / "shared-find"
    d1 = Settings(warehouse=tmp_path / "d1", find_dir=shared)
    d2 = Settings(warehouse=tmp_path / "d2", find_dir=shared)
    for s in (d1, d2):
        shutil.copytree(lake[0].warehouse, s.warehouse, ignore=shutil.ignore_patterns("find"))
    assert find.build_index(d1).mode == "built"
    run_ingest([_penguins(tmp_path, "d1", 21, "penguins of the first copy")], d1)
    assert find.refresh_index(d1).mode == "refreshed"
    run_ingest([_penguins(tmp_path, "d2", 22, "penguins of the second copy")], Settings(warehouse=d2.warehouse))
    # the same tables, the same snapshot id, other contents
    meta = find.index_info(d1)
    assert find.lake_state(d2, int(meta["snapshot_id"])).latest == int(meta["snapshot_id"])
    assert find.index_info(d2)["same_warehouse"] is False
    with pytest.raises(find.FindIndexForeign):
        find.Finder(d2)
    r = _fh("search", "penguins", "--warehouse", str(d2.warehouse), "--format", "json", FEATUREHOUSE_FIND_DIR=str(shared))
    assert r.returncode == 0 and "another warehouse" in r.stderr, r.stderr
    assert [row["feature_index"] for row in json.loads(r.stdout)] == [22]
    with find.Finder(d2) as f:
        assert [row[2] for row in f.search("penguins").rows] == [22]


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_queries_on_a_path_that_is_no_warehouse_leave_nothing(tmp_path, kind):
    from pipeline.lake import warehouse as warehouse_mod

    wh = tmp_path / "wh"
    if kind == "empty":
        wh.mkdir()
    settings = Settings(warehouse=wh)
    for call in (lambda: find.Finder(settings), lambda: find.Finder(settings, fresh="refresh"),
                 lambda: find.refresh_index(settings), lambda: find.show(settings, "m/s/1")):
        with pytest.raises(warehouse_mod.WarehouseMissing):
            call()
    for args in (["search", "jokes"], ["search", "jokes", "--refresh"], ["similar", "m/s/1"], ["by-token", "x"],
                 ["show", "m/s/1"], ["index"]):
        r = _fh(*args, "--warehouse", str(wh))
        assert r.returncode == 1 and "Traceback" not in r.stderr and "no warehouse" in r.stderr, (args, r.stderr)
    assert not (wh / "find").exists()
    assert wh.exists() == (kind == "empty")


def test_find_folder_and_html_errors_are_one_line(other_lake, tmp_path):
    import shutil

    wh = tmp_path / "wh"
    shutil.copytree(other_lake.warehouse, wh, ignore=shutil.ignore_patterns("find"))
    key = "other-model/5-res/3"

    def one_line(r: subprocess.CompletedProcess, code: int = 1) -> str:
        assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("Error:"), r.stderr
        return r.stderr

    (wh / "find").write_text("not a folder")
    assert "not a folder" in one_line(_fh("search", "penguins", "--warehouse", str(wh)))
    assert "not a folder" in one_line(_fh("index", "--warehouse", str(wh)))
    one_line(_fh("search", "penguins", "--warehouse", str(wh), FEATUREHOUSE_FIND_DIR="/etc/passwd"))
    (wh / "find").unlink()
    assert "--html" in one_line(_fh("show", key, "--warehouse", str(wh), "--html", ""), 2)
    one_line(_fh("show", key, "--warehouse", str(wh), "--html", "/proc/version"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        prefix = []
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                return
            prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
        r = subprocess.run(prefix + [str(FEATUREHOUSE), "show", key, "--warehouse", str(wh), "--html",
                                     str(locked / "sub" / "f.html")], capture_output=True, text=True, timeout=120)
        assert "ermission denied" in one_line(r)
    finally:
        locked.chmod(0o755)


def test_a_long_lived_finder_follows_a_refresh_by_another(lake, tmp_path):
    settings = _copy(lake, tmp_path)
    with find.Finder(settings) as f:
        assert f.search("penguins").rows == [] and f.similar(f"{MODEL}/{SOURCE}/0", limit=2).rows
        # another process's load (in this one, for speed): the catalog changed, the index not yet
        run_ingest([_penguins(tmp_path, "p", 31, "penguins on ice")], settings)
        stale = f.search("penguins")
        assert stale.rows == [] and "changed since" in stale.note
        find.refresh_index(settings)  # moves a new index.duckdb over the old one
        got = f.search("penguins")
        assert [r[2] for r in got.rows] == [31] and got.note is None
        assert f.similar("other-model/3-res/31", limit=2).rows[0][4] == "embedding"
        assert f.by_token("t0_2", limit=2000).note is None


def test_show_html_escapes_control_characters_and_isolates_bidi(other_lake):
    view = find.show(other_lake, "other-model/5-res/3", n_neighbours=0)
    view.explanations.append({"description": "abc\u202eevil\u2066x", "explanation_model": "m\u202e",
                              "type_name": None, "has_embedding": False})
    page = find.render_html(view)
    assert not any(c in page for c in "\x1b\x07\u202e\u2066")
    assert "\\x1b[31mred" in page and "\\x1b[2J" in page and "abc\\u202eevil\\u2066x" in page
    assert "<bdi>penguins" in page and "unicode-bidi: isolate" in page


def test_similar_with_nothing_near_counts_the_features_it_was_narrowed_to(lake):
    """Issue 45: with --source the message counted the whole index ("holds 2001 feature(s); none
    other has an embedding..."), which was false of the source asked for."""
    settings, _ = lake
    # a model and a source the index holds, but no feature of both
    r = _fh("similar", "gpt-oss-20b/11-resid-post-aa/8", "--model", "gpt-oss-20b", "--source", SOURCE,
            "--warehouse", str(settings.warehouse))
    assert r.returncode == 0, r.stderr
    assert f"holds 0 feature(s) of model gpt-oss-20b source {SOURCE}; none other of them" in r.stdout, r.stdout
    # (a source the index does not hold at all is named so: test_a_model_or_source_the_index_does_not_hold...)


def test_a_model_or_source_the_index_does_not_hold_is_named_with_the_nearest(lake):
    """Review: `search cpu --source nope` answered "(no match)", and `similar` with a source one
    letter short said the index held 0 features of it, neither saying there is no such source."""
    settings, _ = lake
    with pytest.raises(find.NoSuchSource, match="holds no source '24-gemmascope-2-res-262' \\(did you mean "):
        find.search(settings, "jokes", source="24-gemmascope-2-res-262")
    for args in (["search", "jokes"], ["similar", f"{MODEL}/{SOURCE}/0"], ["by-token", "paris"]):
        r = _fh(*args, "--source", "nope", "--warehouse", str(settings.warehouse))
        assert r.returncode == 2 and "holds no source 'nope'" in r.stderr, (args, r.stderr)
    r = _fh("search", "jokes", "--model", MODEL[:-2], "--warehouse", str(settings.warehouse))
    assert r.returncode == 2 and f"did you mean {MODEL}" in r.stderr, r.stderr
    assert len(find.search(settings, "jokes", source=SOURCE, limit=3)) == 3  # a source it holds narrows as before


def test_show_reads_every_part_from_one_snapshot_while_a_load_commits(lake, tmp_path, monkeypatch):
    """The card's parts are read at once, each on its own cursor: a load that commits after
    the card took its snapshot, before the parts are read, changes none of them."""
    import threading

    from pipeline.lake import warehouse
    from pipeline.outputs.find import card

    settings = _copy(lake, tmp_path)
    with warehouse.connect(settings, read_only=True) as conn:  # a feature with excerpts and statistics
        (index,) = conn.execute("SELECT min(feature_index) FROM feature_activation_stats WHERE model_id = ? "
                                "AND source_id = ?", [MODEL, SOURCE]).fetchone()
    again = good_page(index, model=MODEL, source=SOURCE)
    again["explanations"][0].update(description="jokes about penguins", embedding=_unit(5))
    for a in again["activations"]:
        a["tokens"] = ["penguin"] * len(a["tokens"])
    inbox = write(tmp_path / "in" / "again.json", to_api_json(again))
    key = (MODEL, SOURCE, index)
    read, once, loaded = card._read, threading.Lock(), []

    def read_after_a_load(conn, sql, params):
        with once:
            if not loaded:  # the first part to be read: another process commits first
                loaded.append(_fh("ingest", str(inbox), "--warehouse", str(settings.warehouse), "--no-progress"))
        return read(conn, sql, params)

    with warehouse.connect(settings, read_only=True) as conn:
        before = conn.execute(f"SELECT id FROM {warehouse.CATALOG}.current_snapshot()").fetchone()[0]
        monkeypatch.setattr(card, "_read", read_after_a_load)
        view = find.show(settings, key, n_excerpts=50, n_neighbours=0, lake=conn, captures=True)
        monkeypatch.setattr(card, "_read", read)
        after = find.show(settings, key, n_excerpts=50, n_neighbours=0, lake=conn, captures=True)
    assert loaded and loaded[0].returncode == 0, loaded[0].stderr[-2000:]
    assert view.extra["snapshot"]["id"] == before < after.extra["snapshot"]["id"]
    assert "jokes about penguins" not in [e["description"] for e in view.explanations]
    assert view.excerpts and all("penguin" not in e["tokens"] for e in view.excerpts)
    assert view.stats and all("penguin" not in (s["top_tokens"] or []) for s in view.stats)
    # ... and read again, the card is the load's
    assert "jokes about penguins" in [e["description"] for e in after.explanations]
    assert after.excerpts and all(set(e["tokens"]) == {"penguin"} for e in after.excerpts)
    assert {c["table_name"] for c in after.extra["captures"]} >= {"activations", "explanations"}
    assert {c["run_id"] for c in after.extra["captures"]} != {c["run_id"] for c in view.extra["captures"]}


# --- the feature card from the index ---------------------------------------------------------


def _many_excerpts_page(index: int) -> dict:
    """A feature with 14 excerpts: ties on the peak (the order falls to the excerpt's id), a peak at
    the first token and at the last (the context cut at each end), one past 12 tokens each side,
    a NULL peak and a NULL data source."""
    page = good_page(index, model="card-model", source="3-res")
    acts = []
    for i in range(14):
        values = [round(0.25 * ((i * 7 + j) % 5), 2) for j in range(40)] if i != 3 else [0.0] * 3
        peak = max(values)
        at = {0: 0, 1: 39, 2: 20}.get(i, values.index(peak))
        values[at] = peak = 9.5 if i in (4, 5, 6) else peak + 0.5 + i / 100
        acts.append({**page["activations"][0], "id": f"act-card-{index}-{13 - i:02d}",
                     "dataSource": ["Chat", "Non-Chat", None][i % 3], "tokens": [f"w{i}_{j}" for j in range(len(values))],
                     "values": values, "maxValue": peak, "maxValueTokenIndex": at, "minValue": min(values)})
    page["activations"] = acts
    page["explanations"].append({"id": f"exp-card-{index}-b", "description": "a second explanation",
                                 "explanationModelName": "claude", "typeName": "oai_token-act-pair", "scores": [],
                                 "embedding": _unit(index)})
    return page


def _card_parts(view) -> dict:
    return {"feature": view.feature, "stats": view.stats, "explanations": view.explanations,
            "excerpts": view.excerpts, "peaks": sorted(view.extra["peaks"], key=lambda v: (v is None, v)),
            "captures": view.extra.get("captures")}


def test_a_card_from_the_index_is_the_lakes_card(lake, tmp_path, monkeypatch):
    """When the find index is current, `show` answers from its card tables without reading the
    lake, and every part equals the lake's card of the same snapshot: for every feature of the
    warehouse, at the sizes the web app and the CLI ask for; one the index cannot answer (more
    excerpts or context than it keeps, a commit since) is read from the lake."""
    from pipeline.lake import warehouse

    settings = _copy(lake, tmp_path)
    run_ingest([write(tmp_path / "in" / "many.json", to_api_json(_many_excerpts_page(11)))], settings)
    assert find.refresh_index(settings).mode == "refreshed"
    with warehouse.connect(settings, read_only=True) as conn:
        keys = conn.execute("""SELECT DISTINCT model_id, source_id, feature_index FROM (
                                   SELECT model_id, source_id, feature_index FROM explanations
                                   UNION ALL SELECT model_id, source_id, feature_index FROM feature_activation_stats)
                               ORDER BY ALL""").fetchall()
        snap = conn.execute(f"SELECT id FROM {warehouse.CATALOG}.current_snapshot()").fetchone()[0]
        # the snapshot a card says it was read at: DuckLake's own last one, its id and its time
        (sid, at), = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {warehouse.CATALOG}.snapshots() "
                                  "ORDER BY snapshot_id DESC LIMIT 1").fetchall()
        assert card.latest_snapshot(conn) == {"id": snap, "time": at} and sid == snap
    assert len(keys) > 1000 and ("card-model", "3-res", 11) in keys
    sizes = [(10, 12), (5, 12), (3, 4), (14, 12), (10, 0), (2, 13), (0, 12)]
    with find.Finder(settings) as finder, warehouse.connect(settings, read_only=True) as conn:
        for n, ctx in sizes:
            for key in (keys[::10] if (n, ctx) == (10, 12) else keys[::97]) + [("card-model", "3-res", 11)]:
                got = find.show(settings, key, n_excerpts=n, context=ctx, n_neighbours=0, lake=conn, finder=finder,
                                captures=True)
                assert got.extra["from"] == ("index" if n <= 10 and ctx <= 12 else "lake"), (key, n, ctx)
                assert got.extra["snapshot"]["id"] == snap
                monkeypatch.setattr(finder, "card", lambda *a, **kw: None)  # the lake's card
                want = find.show(settings, key, n_excerpts=n, context=ctx, n_neighbours=0, lake=conn, finder=finder,
                                 captures=True)
                monkeypatch.undo()
                assert want.extra["from"] == "lake"
                assert _card_parts(got) == _card_parts(want), (key, n, ctx)
        many = find.show(settings, ("card-model", "3-res", 11), n_excerpts=10, n_neighbours=3, finder=finder)
    assert len(many.excerpts) == 10 and len(many.extra["peaks"]) == 14 and len(many.explanations) == 2
    assert [e["max_value"] for e in many.excerpts][:3] == [9.5, 9.5, 9.5]
    assert many.neighbours is not None and len(many.neighbours.rows) == 3
    # a commit since the index's snapshot: the card is the lake's, and it holds the change
    page = _many_excerpts_page(11)
    page["explanations"][0]["description"] = "rewritten after the index"
    run_ingest([write(tmp_path / "in2" / "again.json", to_api_json(page))], settings)
    stale = find.show(settings, ("card-model", "3-res", 11), n_neighbours=0)
    assert stale.extra["from"] == "lake" and "rewritten after the index" in [e["description"] for e in stale.explanations]
    find.refresh_index(settings)
    fresh = find.show(settings, ("card-model", "3-res", 11), n_neighbours=0, captures=True)
    assert fresh.extra["from"] == "index" and _card_parts(fresh) == _card_parts(stale) | {"captures": fresh.extra["captures"]}
    assert {c["table_name"] for c in fresh.extra["captures"]} == {"features", "activations", "explanations"}
    with warehouse.connect(settings, read_only=True) as conn:
        assert fresh.extra["snapshot"]["id"] == conn.execute(
            f"SELECT id FROM {warehouse.CATALOG}.current_snapshot()").fetchone()[0]
    # a commit that touches no table the index reads: the card is still the index's, read at the
    # lake's latest snapshot (the footer of the web page says the snapshot the rest of the app says)
    run_ingest([write(tmp_path / "in3" / "notes.txt", b"not a feature page")], settings)
    with warehouse.connect(settings, read_only=True) as conn:
        latest = conn.execute(f"SELECT id FROM {warehouse.CATALOG}.current_snapshot()").fetchone()[0]
        later = find.show(settings, ("card-model", "3-res", 11), n_neighbours=0, lake=conn)
    assert latest > fresh.extra["snapshot"]["id"] and later.extra["from"] == "index"
    assert later.extra["snapshot"]["id"] == latest
    # the card tables hold only what the index's features are (nothing left of a replaced capture)
    with find.Finder(settings) as finder:
        for t in card_tables():
            (orphans,) = finder.conn.execute(f"SELECT count(*) FROM {t} ANTI JOIN features USING (fid)").fetchone()
            assert orphans == 0, t


def card_tables() -> tuple[str, ...]:
    from pipeline.outputs.find.build import _CARD_TABLES

    return _CARD_TABLES
