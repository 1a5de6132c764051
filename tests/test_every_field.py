"""Nothing a real record carries is dropped: every key of every record shape we receive (the
seed page in each format, both explanation-export producers, the second activation producer,
feature, model, source and source-set rows) is in the warehouse, in a column or in its
table's ``extra``; and both roads (DuckDB's reader, the Python parser) store the same."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest

from pipeline.config import Settings
from tests.conftest import open_warehouse, query, run_ingest, tables_rows, write
from tests.formats import all_formats

FIXTURES = Path(__file__).parent / "fixtures"
SEED = FIXTURES / "000_e9e35889d0228029.txt"

#: record key → warehouse column, per table (the key with no entry must be in ``extra``)
COLUMNS = {
    "features": {"modelId": "model_id", "layer": "source_id", "index": "feature_index",
                 "sourceSetName": "source_set_name", "maxActApprox": "max_act_approx",
                 "frac_nonzero": "frac_nonzero", "pos_str": "pos_str", "pos_values": "pos_values",
                 "neg_str": "neg_str", "neg_values": "neg_values", "hookName": "hook_name",
                 "hasVector": "has_vector", "creatorId": "creator_id", "createdAt": "created_at"},
    "activations": {"id": "activation_id", "modelId": "model_id", "layer": "source_id", "index": "feature_index",
                    "dataSource": "data_source", "dataIndex": "data_index", "tokens": "tokens", "values": "values",
                    "maxValue": "max_value", "maxValueTokenIndex": "max_value_token_index", "minValue": "min_value",
                    "dfaValues": "dfa_values", "dfaTargetIndex": "dfa_target_index", "dfaMaxValue": "dfa_max_value",
                    "lossValues": "loss_values", "logitContributions": "logit_contributions", "binMin": "bin_min",
                    "binMax": "bin_max", "binContains": "bin_contains",
                    "qualifyingTokenIndex": "qualifying_token_index", "creatorId": "creator_id",
                    "createdAt": "created_at"},
    "explanations": {"id": "explanation_id", "modelId": "model_id", "layer": "source_id", "index": "feature_index",
                     "description": "description", "explanationModelName": "explanation_model",
                     "typeName": "type_name", "authorId": "author_id", "scores": "scores",
                     "createdAt": "created_at", "embedding": "embedding"},
    "models": {"id": "model_id", "displayName": "display_name", "owner": "owner", "tlensId": "tlens_id",
               "layers": "n_layers", "dimension": "dimension", "createdAt": "created_at", "updatedAt": "updated_at"},
    "sources": {"id": "source_id", "modelId": "model_id", "setName": "source_set_name", "hfRepoId": "hf_repo_id",
                "hfFolderId": "hf_folder_id", "dataset": "dataset", "num_tokens_in_prompt": "num_tokens_in_prompt",
                "createdAt": "created_at"},
    "source_sets": {"modelId": "model_id", "name": "source_set_name", "description": "description",
                    "type": "type_name", "creatorName": "creator_name", "releaseName": "release_name",
                    "urls": "urls", "createdAt": "created_at"},
}
#: a page's relations: loaded into tables of their own
RELATIONS = {"model": "models", "source": "sources", "sourceSet": "source_sets", "activations": "activations",
             "explanations": "explanations"}
ROW_KEY = {"features": ("modelId", "layer", "index"), "activations": ("id",), "explanations": ("id",),
           "models": ("id",), "sources": ("id",), "source_sets": ("name",)}
WH_KEY = {"features": ("model_id", "source_id", "feature_index"), "activations": ("activation_id",),
          "explanations": ("explanation_id",), "models": ("model_id",), "sources": ("source_id",),
          "source_sets": ("source_set_name",)}


def _rows(wh, table: str) -> dict[tuple, dict]:
    """``table``'s rows by key, from the warehouse ``wh`` or through an open connection to it."""
    import duckdb

    if isinstance(wh, duckdb.DuckDBPyConnection):
        return _keyed(wh, table)
    with open_warehouse(wh) as conn:
        return _keyed(conn, table)


def _keyed(conn, table: str) -> dict[tuple, dict]:
    cur = conn.execute(f"SELECT * FROM {table}")
    cols = [d[0] for d in cur.description]
    out = {}
    for r in cur.fetchall():
        row = dict(zip(cols, r))
        out[tuple(str(row[k]) for k in WH_KEY[table])] = row
    return out


def _assert_kept(wh: Path, table: str, records: list[dict], quarantined: set[str] = frozenset()) -> int:
    """Every key of every record is a filled column or a key of ``extra``; returns keys checked."""
    stored = _rows(wh, table)
    checked = 0
    for rec in records:
        if table == "features":
            key = (rec["modelId"], rec["layer"], str(int(rec["index"])))
        else:
            key = tuple(str(rec[k]) for k in ROW_KEY[table])
        if key[0] in quarantined:
            continue
        assert key in stored, f"{table} {key} is not in the warehouse"
        row = stored[key]
        extra = json.loads(row["extra"]) if row.get("extra") else {}
        for k, v in rec.items():
            checked += 1
            if k in RELATIONS and table == "features":
                continue  # checked as records of their own table
            column = COLUMNS[table].get(k)
            if column is not None:
                assert column in row, f"{table}.{column} is missing"
                if v is not None and v != []:
                    assert row[column] is not None, f"{table} {key}: {k}={v!r} but {column} is NULL"
            else:
                assert k in extra, f"{table} {key}: field {k!r} is neither a column nor in extra ({sorted(extra)})"
                if v is not None:
                    assert extra[k] is not None, f"{table} {key}: extra.{k} lost its value {v!r}"
    return checked


def _check_page(wh: Path, page: dict, quarantined: set[str] = frozenset()) -> None:
    n = _assert_kept(wh, "features", [page])
    for rel, table in RELATIONS.items():
        value = page.get(rel)
        records = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        n += _assert_kept(wh, table, records, quarantined)
    assert n > 100


@pytest.mark.parametrize("fmt", ["flight", "api_json", "html", "gzip+api_json"])
def test_every_key_of_the_seed_page_is_kept(tmp_path, seed_page, fmt):
    data = SEED.read_bytes() if fmt == "flight" else all_formats(seed_page)[fmt]
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([write(tmp_path / "in" / f"page.{fmt}", data)], settings)
    with open_warehouse(settings.warehouse) as conn:  # one connection for every table's read (~0.3 CPU-s each)
        quarantined = {k for (k,) in conn.execute("SELECT record_key FROM quarantine").fetchall()}
        _check_page(conn, seed_page, quarantined)
        # the page's relations that have no table of their own, and the explanation's flag
        (extra,) = conn.execute("SELECT extra FROM features").fetchall()[0]
        assert {"lists", "creator", "comments"} <= set(json.loads(extra))
        assert "triggeredByUser" in json.loads(conn.execute("SELECT extra FROM explanations").fetchall()[0][0])


EMBEDDING = [round((i - 128) / 1000, 9) for i in range(256)]
EXPLANATION_ROWS = [
    # the database dump's producer: umap_* columns, the embedding a JSON string
    {"id": "exp-a", "modelId": "m", "layer": "5-res", "index": "3", "authorId": "u1", "description": "dates",
     "embedding": json.dumps(EMBEDDING), "typeName": "oai", "explanationModelName": "gemini-2.0-flash",
     "umap_x": 1.5, "umap_y": -2.25, "umap_cluster": 7, "umap_log_feature_sparsity": -3.5},
    # the auto-interp producer: notes, triggeredById, a zoneless createdAt, the embedding a list,
    # and a field nobody told us about
    {"id": "exp-b", "modelId": "m", "layer": "5-res", "index": "4", "description": " jokes", "authorId": "u2",
     "embedding": EMBEDDING, "triggeredById": "run-9", "typeName": "oai_token-act-pair",
     "explanationModelName": "gpt-4o-mini", "notes": "checked by hand", "createdAt": "2026-02-18T17:18:05.554834",
     "reviewScore": {"votes": 3}},
]
ACTIVATION_ROWS = [
    {"id": "act-a", "modelId": "m", "layer": "5-res", "index": "3", "creatorId": "c", "dataSource": None,
     "tokens": ["a", " b"], "maxValue": 2.5, "minValue": 0, "values": [0, 2.5], "maxValueTokenIndex": 1,
     "dfaValues": [], "dfaMaxValue": None, "dfaTargetIndex": None, "binContains": -1, "binMin": -1, "binMax": None,
     # the second producer's columns
     "createdAt": "2026-02-18T17:18:05.554834", "dataIndex": "991", "lossValues": [0.5, 0.25],
     "logitContributions": "{\"pos\": []}", "qualifyingTokenIndex": 1, "zValues": [0.0, 1.25],
     "someNewColumn": "kept"},
]
FEATURE_ROWS = [
    {"modelId": "m", "layer": "5-res", "index": 3, "sourceSetName": None, "maxActApprox": 2.5, "frac_nonzero": 0.01,
     "pos_str": ["x"], "pos_values": [1.0], "neg_str": [], "neg_values": [], "hookName": "h", "hasVector": False,
     "umap_x": 0.5, "freq_hist_data_bar_heights": [], "anUnknownField": [1, 2]},
    # two lines: one line holding one object is an API page, which claims all three tables
    {"modelId": "m", "layer": "5-res", "index": 4, "sourceSetName": "res", "maxActApprox": 1.0, "frac_nonzero": 0.0},
]
MODEL_ROW = {"id": "m", "displayName": "M", "layers": 12, "dimension": 768, "owner": "o", "tlensId": "t",
             "instruct": True, "website": "https://m"}
SOURCE_ROW = {"id": "5-res", "modelId": "m", "setName": "res", "hfRepoId": "r", "saelensConfig": {"d_sae": 16384},
              "num_prompts": 10}
SOURCESET_ROW = {"modelId": "m", "name": "res", "description": "d", "type": "sae", "urls": [], "showDfa": False}


def _export(tmp: Path, name: str, rows: list[dict], gz: bool) -> Path:
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    return write(tmp / f"{name}.jsonl{'.gz' if gz else ''}", gzip.compress(data) if gz else data)


@pytest.fixture(scope="module", params=["gzip (DuckDB's reader)", "plain (the Python parser)"])
def export_load(request, tmp_path_factory):
    gz = request.param.startswith("gzip")
    tmp = tmp_path_factory.mktemp("exports")
    files = [_export(tmp, "explanations", EXPLANATION_ROWS, gz), _export(tmp, "activations", ACTIVATION_ROWS, gz),
             _export(tmp, "features", FEATURE_ROWS, gz), _export(tmp, "model", [MODEL_ROW], False),
             _export(tmp, "source", [SOURCE_ROW], False), _export(tmp, "sourceset", [SOURCESET_ROW], False)]
    settings = Settings(warehouse=tmp / "wh")
    summary = run_ingest(files, settings)
    assert summary.n_quarantined == 0 and summary.n_rejected == 0
    return settings.warehouse


@pytest.mark.parametrize(("table", "rows"), [
    ("explanations", EXPLANATION_ROWS), ("activations", ACTIVATION_ROWS), ("features", FEATURE_ROWS),
    ("models", [MODEL_ROW]), ("sources", [SOURCE_ROW]), ("source_sets", [SOURCESET_ROW]),
])
def test_every_key_of_export_rows_is_kept(export_load, table, rows):
    assert _assert_kept(export_load, table, rows) >= len(rows[0])


def test_embeddings_are_numbers_in_both_encodings(export_load):
    got = dict(query(export_load, "SELECT explanation_id, embedding FROM explanations"))
    assert got == {"exp-a": EMBEDDING, "exp-b": EMBEDDING}
    (extra,) = query(export_load, "SELECT extra FROM explanations WHERE explanation_id = 'exp-b'")[0]
    assert json.loads(extra)["reviewScore"] == {"votes": 3} and json.loads(extra)["notes"] == "checked by hand"


def test_both_roads_store_the_same(tmp_path):
    loads = {}
    for gz in (True, False):
        wh = tmp_path / ("gz" if gz else "plain")
        files = [_export(wh.parent / f"in-{gz}", "explanations", EXPLANATION_ROWS, gz),
                 _export(wh.parent / f"in-{gz}", "activations", ACTIVATION_ROWS, gz),
                 _export(wh.parent / f"in-{gz}", "features", FEATURE_ROWS, gz)]
        run_ingest(files, Settings(warehouse=wh))
        loads[gz] = tables_rows(wh, ("explanations", "activations", "features"))
    for t in loads[True]:
        for a, b in zip(loads[True][t], loads[False][t], strict=True):
            a = tuple(json.loads(v) if isinstance(v, str) and v[:1] in "{[" else v for v in a)
            b = tuple(json.loads(v) if isinstance(v, str) and v[:1] in "{[" else v for v in b)
            assert a == b, t


BAD_EMBEDDINGS = [
    ("a value is a string", ["0.5"] * 256, "embedding_is_numbers"),
    ("a null inside", [0.5] * 255 + [None], "embedding_is_numbers"),
    ("a string that is not JSON", "[0.5, 0.5", "embedding_is_numbers"),
    ("an object", {"values": [0.5]}, "embedding_is_numbers"),
    ("255 values", [0.5] * 255, "embedding_dimension"),
    ("257 values, as a string", json.dumps([0.5] * 257), "embedding_dimension"),
    ("nested lists", [[0.5]] * 256, "embedding_is_numbers"),
    ("all zeros (no direction: cosine undefined)", [0.0] * 256, "embedding_not_zero"),
    ("all zeros, as a string", json.dumps([0] * 256), "embedding_not_zero"),
    # outside review: numbers whose squares' sum is 0 or overflows have no length to normalise by
    ("subnormal values (1e-320): the squares sum to 0", [1e-320] * 256, "embedding_not_zero"),
    ("huge values (1e308): the squares overflow", [1e308] * 256, "embedding_not_zero"),
    # what DuckDB's JSON cast reads as numbers though the grammar of a list of numbers does not
    ("a string holding strings", json.dumps(["0.5"] * 256), "embedding_is_numbers"),
    ("a string holding true", json.dumps([True] + [0.5] * 255), "embedding_is_numbers"),
    ("a string holding false", json.dumps([0.5] * 255 + [False]), "embedding_is_numbers"),
    ("a string with a comma before its end", json.dumps([0.5] * 256)[:-1] + " ,\n ] ", "embedding_is_numbers"),
    ("a string holding NaN", json.dumps([0.5] * 255)[:-1] + ", NaN]", "embedding_is_numbers"),
]


@pytest.mark.parametrize("gz", [True, False], ids=["gzip (DuckDB's reader)", "plain (the Python parser)"])
def test_a_bad_embedding_is_quarantined_not_loaded(tmp_path, gz):
    rows = [dict(EXPLANATION_ROWS[1], id=f"bad-{i}", index=str(10 + i), embedding=e)
            for i, (_, e, _) in enumerate(BAD_EMBEDDINGS)] + [EXPLANATION_ROWS[1]]
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_export(tmp_path / "in", "explanations", rows, gz)], settings)
    assert query(settings.warehouse, "SELECT explanation_id FROM explanations") == [("exp-b",)]
    fired = dict(query(settings.warehouse, "SELECT record_key, check_name FROM quarantine"))
    assert fired == {f"bad-{i}": check for i, (_, _, check) in enumerate(BAD_EMBEDDINGS)}


def _edge_texts() -> list[str]:
    """Texts near the grammar of a list of numbers: valid lists, each changed by a character
    put in, taken out or swapped, at the ends and inside."""
    import random

    rnd = random.Random(7)
    seeds = ["[]", "[ ]", "[1]", " [1, 2] ", "[-0.5e-3,1E+5,\n0]", "[0.25, 0.5, 0.75]", "[18446744073709551616]",
             json.dumps([0.5] * 8), "[1e400]", "[-0]"]
    alphabet = list(' \t\n\r\f,[]{}".-+eE0123456789') + ["true", "false", "null", "NaN", "Infinity", "-Infinity",
                                                         '"1"', "/*c*/", "\ufeff", "x", "0x1"]
    texts = set(seeds)
    for seed in seeds:
        for _ in range(600):
            t, i = seed, rnd.randrange(len(seed) + 1)
            op = rnd.randrange(3)
            if op == 0:
                t = t[:i] + rnd.choice(alphabet) + t[i:]
            elif op == 1 and t:
                t = t[:i] + t[i + 1:]
            elif t:
                t = t[:i] + rnd.choice(alphabet) + t[i + 1:]
            texts.add(t)
    return sorted(texts)


def test_the_embedding_check_is_the_number_list_grammar():
    """The export road's check that an embedding's text is a list of finite numbers (without a
    regular expression: it cost 10x the CPU) agrees with the JSON grammar of such a list, on
    valid lists and every text one edit away from one."""
    import duckdb

    from pipeline.stages import columns

    texts = _edge_texts()
    conn = duckdb.connect()
    conn.execute("CREATE TABLE t (_emb_text VARCHAR)")
    conn.executemany("INSERT INTO t VALUES (?)", [[x] for x in texts])
    got = conn.execute(f"""
        SELECT _emb_text, {columns._EMBEDDING_NUMERIC} AS numeric,
               coalesce(regexp_full_match(_emb_text, '{columns._NUMBER_LIST}') AND list_count(_emb_nums) = len(_emb_nums)
                        AND len(list_filter(_emb_nums, x -> NOT isfinite(x))) = 0, false) AS grammar,
               -- the numbers as DuckDB's cast of the text to JSON, then to DOUBLE[], reads them
               CAST(_emb_nums AS VARCHAR) IS NOT DISTINCT FROM
                   CAST(TRY_CAST(TRY_CAST(_emb_text AS JSON) AS DOUBLE[]) AS VARCHAR) AS same_numbers
        FROM (SELECT _emb_text, {columns._EMBEDDING_NUMBERS} AS _emb_nums FROM t)""").fetchall()
    assert len(got) > 2500 and sum(n for _, n, _, _ in got) > 100  # both kinds, many of each
    assert [t for t, numeric, grammar, _ in got if numeric != grammar] == []
    assert [t for t, _, _, same in got if not same] == []


def test_a_version_4_warehouse_upgrades(tmp_path):
    """Schema 5 on a warehouse made before it: the new columns appear (empty for old rows) and
    `upgrade` fills feature_token_stats for the features already loaded."""
    import subprocess
    import sys

    from pipeline.lake import warehouse as wh
    from tests.conftest import good_page
    from tests.formats import to_api_json

    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([write(tmp_path / "in" / "p.json", to_api_json(good_page(7)))], settings)
    with wh.connect(settings) as conn:  # back to what schema 4 made
        for sql in ("ALTER TABLE explanations DROP COLUMN embedding", "ALTER TABLE explanations DROP COLUMN extra",
                    "ALTER TABLE activations DROP COLUMN extra", "DROP TABLE feature_token_stats",
                    "DELETE FROM schema_version WHERE version = 5"):
            conn.execute(sql)
    fh = Path(sys.executable).parent / "featurehouse"
    r = subprocess.run([str(fh), "status", "--warehouse", str(settings.warehouse)], capture_output=True, text=True)
    assert r.returncode == 1 and "featurehouse upgrade" in r.stderr
    r = subprocess.run([str(fh), "upgrade", "--warehouse", str(settings.warehouse)], capture_output=True, text=True)
    assert r.returncode == 0 and "schema version 4 -> 5" in r.stdout and "filled for 1 features" in r.stdout, r.stderr
    assert query(settings.warehouse, "SELECT explanation_id, embedding, extra FROM explanations") == [
        ("exp-gpt-oss-20b-11-resid-post-aa-7", None, None)]
    assert query(settings.warehouse, "SELECT token, max_activation, n_peak_excerpts FROM feature_token_stats "
                                     "ORDER BY token") == [("t0_1", 1.5, 0), ("t0_2", 3.25, 1), ("t1_0", 2.0, 1),
                                                           ("t2_1", 0.5, 1)]



@pytest.mark.parametrize("where", ["embedding", "umap_x"])
def test_nan_on_the_first_line_of_an_export_is_that_lines_fault_only(tmp_path, where):
    """A NaN (not JSON) on the first line of a gzip explanations export refused the whole file
    (its kind is judged by its first line); it is now what the same line is anywhere else in
    the file: that record's fault, and the other lines load."""
    row = dict(EXPLANATION_ROWS[1], id="exp-nan", index="40", embedding=[0.5] * 256)
    row[where] = ["@NAN@"] + [0.5] * 255 if where == "embedding" else "@NAN@"
    nan = orjson.dumps(row).replace(b'"@NAN@"', b"NaN")
    rows = [orjson.dumps(r) for r in EXPLANATION_ROWS]
    outcome = {}
    for name, lines in (("first", [nan, *rows]), ("second", [rows[0], nan, *rows[1:]])):
        path = write(tmp_path / name / "explanations.jsonl.gz", gzip.compress(b"\n".join(lines) + b"\n"))
        settings = Settings(warehouse=tmp_path / name / "wh")
        summary = run_ingest([path], settings)
        assert summary.n_rejected == 0, summary.rejected
        outcome[name] = (summary.n_quarantined, sorted(query(settings.warehouse, "SELECT explanation_id FROM explanations")))
        assert {r["id"] for r in EXPLANATION_ROWS} <= {i for (i,) in outcome[name][1]}
    assert outcome["first"] == outcome["second"]
    if where == "embedding":  # not 256 finite numbers
        assert outcome["first"][0] == 1 and ("exp-nan",) not in outcome["first"][1]
