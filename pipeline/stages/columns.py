"""The staging tables' columns: which fields of a page, an activation, an explanation and a
bulk-export row DuckDB reads typed, whether its typed read of an object gives what the Python
road makes of it (``_exact_fields``), and the SQL that turns those JSON fields into the
``stage_<table>`` columns (timestamps, ``extra``, an explanation's embedding, each road's
select lists and ``_row`` ids).

One concern: the columns. The roads that read into them are ``stage.py`` (API-JSON pages and
the views), ``export_road.py`` (bulk-export batches) and ``parse.py`` (the Python road).
"""

from __future__ import annotations

import re
from typing import Any

import duckdb
import orjson
import simdjson

from .records import (
    ACTIVATION_COLUMN_FIELDS,
    ACTIVATION_EXTRA_FIELDS,
    EXPLANATION_COLUMN_FIELDS,
    EXPLANATION_EXTRA_FIELDS,
    FEATURE_COLUMN_FIELDS,
    FEATURE_EXTRA_FIELDS,
    PAGE_RELATIONS,
)

_PY_ROW_BASE = 1 << 40  # _row ids of Python-road records; DuckDB-road ids are page << 20 | position

#: Typed fields of an activation and of an explanation, as pages nest them and as bulk-export
#: rows carry them (a field a source lacks reads as NULL; one we do not know is ignored).
_ACTIVATION_FIELDS: dict[str, str] = {
    "id": "VARCHAR", "modelId": "VARCHAR", "layer": "VARCHAR", "index": "VARCHAR",
    "dataSource": "VARCHAR", "dataIndex": "VARCHAR", "tokens": "VARCHAR[]", "values": "DOUBLE[]",
    "maxValue": "DOUBLE", "maxValueTokenIndex": "INTEGER", "minValue": "DOUBLE",
    "dfaValues": "DOUBLE[]", "dfaTargetIndex": "INTEGER", "dfaMaxValue": "DOUBLE",
    "lossValues": "DOUBLE[]", "logitContributions": "VARCHAR", "binMin": "DOUBLE",
    "binMax": "DOUBLE", "binContains": "DOUBLE", "qualifyingTokenIndex": "INTEGER",
    "creatorId": "VARCHAR", "createdAt": "VARCHAR",
    **{f: "JSON" for f in ACTIVATION_EXTRA_FIELDS},
}
_EXPLANATION_FIELDS: dict[str, str] = {
    "id": "VARCHAR", "modelId": "VARCHAR", "layer": "VARCHAR", "index": "VARCHAR",
    "description": "VARCHAR", "explanationModelName": "VARCHAR", "typeName": "VARCHAR",
    "authorId": "VARCHAR", "scores": "JSON", "createdAt": "VARCHAR", "embedding": "JSON",
    **{f: "JSON" for f in EXPLANATION_EXTRA_FIELDS},
}
assert set(_ACTIVATION_FIELDS) == ACTIVATION_COLUMN_FIELDS | set(ACTIVATION_EXTRA_FIELDS)
assert set(_EXPLANATION_FIELDS) == EXPLANATION_COLUMN_FIELDS | set(EXPLANATION_EXTRA_FIELDS)


def _struct_list(fields: dict[str, str]) -> str:
    return "STRUCT(" + ", ".join(f'"{k}" {v}' for k, v in fields.items()) + ")[]"


_PAGE_COLUMNS: dict[str, str] = {
    "modelId": "VARCHAR", "layer": "VARCHAR", "index": "VARCHAR", "sourceSetName": "VARCHAR",
    "maxActApprox": "DOUBLE", "frac_nonzero": "DOUBLE", "pos_str": "VARCHAR[]",
    "pos_values": "DOUBLE[]", "neg_str": "VARCHAR[]", "neg_values": "DOUBLE[]",
    "hookName": "VARCHAR", "hasVector": "BOOLEAN", "creatorId": "VARCHAR", "createdAt": "VARCHAR",
    **{f: "JSON" for f in FEATURE_EXTRA_FIELDS},
    "model": "JSON", "source": "JSON", "sourceSet": "JSON",
    "activations": _struct_list(_ACTIVATION_FIELDS), "explanations": _struct_list(_EXPLANATION_FIELDS),
    # Present only on bulk-export activation / explanation rows, which are not pages:
    "tokens": "JSON", "values": "JSON", "description": "JSON",
}


assert {k for k in _PAGE_COLUMNS if k not in ("tokens", "values", "description")} == (
    FEATURE_COLUMN_FIELDS | set(FEATURE_EXTRA_FIELDS) | PAGE_RELATIONS)

#: The page's and an activation's fields DuckDB reads as lists of numbers.
_NUMBER_LISTS = [k for k, t in _PAGE_COLUMNS.items() if t == "DOUBLE[]"]


def _numbers_only(v: Any) -> bool:
    """Whether a field read as DOUBLE[] is absent, null or a list of JSON numbers."""
    if v is None:
        return True
    if type(v) is simdjson.Array:
        try:
            v.as_buffer(of_type="d")  # in C, without a Python object per value
        except (TypeError, ValueError):
            return False
        return True
    return type(v) is list and all(type(x) is int or type(x) is float for x in v)


def _typed(fields: dict[str, str]) -> tuple[tuple[str, ...], ...]:
    """A record's fields DuckDB reads as DOUBLE, as INTEGER/BIGINT, as DOUBLE[] and as BOOLEAN."""
    return (tuple(k for k, t in fields.items() if t == "DOUBLE"),
            tuple(k for k, t in fields.items() if t in ("INTEGER", "BIGINT")),
            tuple(k for k, t in fields.items() if t == "DOUBLE[]"),
            tuple(k for k, t in fields.items() if t == "BOOLEAN"))


_ACTIVATION_TYPED = _typed(_ACTIVATION_FIELDS)
_EXPLANATION_TYPED = _typed(_EXPLANATION_FIELDS)
_PAGE_TYPED = _typed({k: t for k, t in _PAGE_COLUMNS.items() if k not in ("activations", "explanations")})
_INDEX_TEXT = re.compile(r"-?[0-9]+")  # coerce._DIGITS: an integer written as text


def _exact_fields(obj: Any, typed: tuple[tuple[str, ...], ...], keys: Any = None) -> bool:
    """Whether DuckDB's typed read of an object's fields gives what the Python road makes of
    them. read_json casts where Python does not: ``"2.5"`` and ``true`` to 2.5 and 1.0 in a
    DOUBLE or a DOUBLE[], ``3.7`` to 4 in an INTEGER, and its cast of an ``index`` written as
    text takes ``"2_004"``, ``" 12"`` and ``"1904.0"``; each of these is a value that is not a
    number (``coerce._num``, ``coerce._int``) to the Python road, which quarantines its record.

    Only the fields the object holds are looked up (``keys``, its keys, if the caller has them):
    a simdjson object's ``get`` of a key it lacks costs ~5 µs (an exception inside), ten times a
    present one's, and an export row lacks several of the typed fields."""
    present = frozenset(obj.keys() if keys is None else keys)
    doubles, integers, lists, booleans = typed
    for k in booleans:  # read_json casts "true" and 1 to true; Python keeps only true/false
        if k in present:
            v = obj[k]
            if v is not None and type(v) is not bool:
                return False
    for k in doubles:
        if k in present:
            v = obj[k]
            if v is not None and type(v) is not float and type(v) is not int:
                return False
    for k in integers:
        if k in present:
            v = obj[k]
            if v is not None and type(v) is not int:
                return False
    if "index" in present:
        index = obj["index"]
        if index is not None and type(index) is not int and not (type(index) is str and _INDEX_TEXT.fullmatch(index)):
            return False
    return all(_numbers_only(obj[k]) for k in lists if k in present)


#: A time of day followed by a UTC offset or ``Z`` (``04:30:34.656+02:00``, ``04:30Z``, ``10:00-05``).
_HAS_OFFSET = r"'[0-9]:[0-9]{2}(:[0-9]{2}([.,][0-9]+)?)?\s*([Zz]|[+-][0-9]{2}(:?[0-9]{2})?)$'"


def _ts(expr: str) -> str:
    """SQL reading an ISO timestamp string as a UTC ``TIMESTAMP``, whatever the session's TimeZone.

    With an offset (or ``Z``) the instant is converted to UTC; without one the time is UTC
    already, as the Python road (``coerce._ts``) reads it. A cast to TIMESTAMPTZ alone would
    read a zoneless time in the session's (the machine's) zone, and a cast to TIMESTAMP alone
    would drop an offset.
    """
    return (f"(CASE WHEN regexp_matches({expr}, {_HAS_OFFSET}) "
            f"THEN TRY_CAST({expr} AS TIMESTAMPTZ) AT TIME ZONE 'UTC' "
            f"ELSE TRY_CAST({expr} AS TIMESTAMP) END)")


def _drop_keys(expr: str, keys: list[str]) -> str:
    patch = orjson.dumps({k: None for k in keys}).decode()
    return f"CAST(json_merge_patch({expr}, '{patch}') AS VARCHAR)"


#: Typed columns of bulk-export rows, by the table they load.
_EXPORT_COLUMNS: dict[str, dict[str, str]] = {
    "activations": _ACTIVATION_FIELDS,
    "explanations": _EXPLANATION_FIELDS,
    "features": {k: v for k, v in _PAGE_COLUMNS.items()
                 if k not in ("model", "source", "sourceSet", "activations", "explanations",
                              "tokens", "values", "description")},
}
_EXPORT_ROW_BASE = 1 << 41  # _row ids of export rows: base + the temp table's rowid


_EXPORT_TYPED = {table: _typed(fields) for table, fields in _EXPORT_COLUMNS.items()}


def _extra_sql(a: str, listed: tuple[str, ...], unlisted: list[str] = ()) -> str:
    """SQL for ``a``'s ``extra``: its ``listed`` fields (null when absent), then the ``unlisted``
    ones (fields of an export file the typed read does not know, read as JSON) that are not
    null, by name: as ``coerce._extra`` builds it on the Python road."""
    listed_sql = "json_object(" + ", ".join(f"'{f}', {a}.\"{f}\"" for f in listed) + ")"
    lit, ident = (lambda f: f.replace("'", "''")), (lambda f: f.replace('"', '""'))
    if not unlisted:
        return f"CAST({listed_sql} AS VARCHAR)"
    entries = ", ".join(f"{{'k': '{lit(f)}', 'v': {a}.\"{ident(f)}\"}}" for f in sorted(unlisted))
    rest = f"CAST(to_json(map_from_entries(list_filter([{entries}], e -> e.v IS NOT NULL))) AS VARCHAR)"
    # two JSON objects' members joined: '{"a":1}' and '{"b":2}' → '{"a":1,"b":2}'
    return (f"(CASE WHEN {rest} = '{{}}' THEN CAST({listed_sql} AS VARCHAR) "
            f"ELSE rtrim(CAST({listed_sql} AS VARCHAR), '}}') || ',' || {rest}[2:] END)")


#: An explanation embedding's JSON text holds only a list of JSON numbers: the grammar, as a
#: regular expression. Not matched on the export road (``_EMBEDDING_NUMERIC`` checks the same
#: without it); the test that holds the two equal matches it.
_NUMBER_LIST = r"\s*\[\s*(NUM(\s*,\s*NUM)*)?\s*\]\s*".replace(
    "NUM", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _embedding_text(e: str) -> str:
    """SQL for the JSON text of an explanation's ``embedding`` (JSON: a list, or a string
    holding one), NULL when it is absent or null; computed once per row, in a subquery. A list
    is known by its first character (read_json writes a JSON value with no space before it):
    ``json_type`` parses the whole value, 0.33 of the 0.66 CPU-s this took over 65,536
    embeddings of 256 values (2026-12-07); any other value is asked ``json_type``."""
    return (f"(CASE WHEN starts_with({e}, '[') THEN CAST({e} AS VARCHAR) "
            f"WHEN json_type({e}) = 'VARCHAR' THEN {e}->>'$' WHEN json_type({e}) = 'NULL' THEN NULL "
            f"ELSE CAST({e} AS VARCHAR) END)")


#: Over a row with ``_emb_text``: its numbers, DOUBLE[] (NULL where the text is not JSON or not
#: a list). DuckDB's JSON reader, once: a cast of the text to JSON then to DOUBLE[] parsed it
#: twice and wrote it once between (1.00 against 0.77 CPU-s for 65,536 embeddings, 2026-12-07;
#: the same lists on every text of ``test_the_embedding_check_is_the_number_list_grammar``).
#: ``try`` makes a text that is not JSON a NULL, as ``TRY_CAST`` did.
_EMBEDDING_NUMBERS = """try(json_transform(_emb_text, '["DOUBLE"]'))"""


#: Over a row with ``_emb_text`` (``_embedding_text``) and ``_emb_nums`` (that text cast to
#: DOUBLE[]): whether the embedding is all finite numbers (the JSON grammar of a list of
#: numbers, ``_NUMBER_LIST``, no value lost in the cast). The text is cast to DOUBLE[] through
#: JSON: DuckDB's JSON reader parses a 256-value list ~6x faster than its VARCHAR-to-list cast
#: (0.9 against 5.9 CPU-s for 65,536 embeddings, 2026-12-06), to the same doubles on every text
#: the grammar takes (``-0`` aside, which the JSON road reads as 0, as orjson does on the Python
#: road). The cast is strict JSON but for what these find: a string (``"1"`` casts to 1.0),
#: ``true``/``false`` (1.0/0.0), a comma before the closing bracket, and NaN/Infinity (not
#: finite); a nested list or ``null`` is a NULL in the list. Checking those is the grammar,
#: without matching it: the grammar's regular expression cost 0.58 CPU-s over 65,536 embeddings
#: of ~3.2 KB, these 0.18 (2026-12-07; ``rtrim`` to find the last comma, 1.9: it reads the whole
#: text); ``test_the_embedding_check_is_the_number_list_grammar`` holds the two equal.
_EMBEDDING_NUMERIC = """
    CASE WHEN _emb_text IS NULL THEN NULL
         ELSE coalesce(list_count(_emb_nums) = len(_emb_nums)
                       AND len(list_filter(_emb_nums, x -> NOT isfinite(x))) = 0
                       AND NOT contains(_emb_text, '"') AND NOT contains(_emb_text, 'true')
                       AND NOT contains(_emb_text, 'false')
                       AND NOT regexp_matches(_emb_text, ',[ \t\n\r]*\\]'), false) END"""
#: ... then ``embedding`` and ``embedding_dim`` (how many values it holds), as
#: ``coerce._embedding`` gives them on the Python road; the suite quarantines a bad one.
_EMBEDDING_COLUMNS = """
    CASE WHEN embedding_numeric THEN _emb_nums END AS embedding,
    CAST(CASE WHEN embedding_numeric THEN len(_emb_nums)
              WHEN json_type(TRY_CAST(_emb_text AS JSON)) = 'ARRAY' THEN json_array_length(TRY_CAST(_emb_text AS JSON))
         END AS INTEGER) AS embedding_dim"""


def _with_embedding(select: str, e: str, *, name: str = "embedding", keep_raw: bool = False) -> str:
    """``select`` (whose rows have the JSON ``e``) with the embedding's columns (the numbers as
    ``name``), each computed once (a subquery a step: DuckDB expands a reference to a column
    alias of the same SELECT). ``keep_raw`` keeps ``e`` where it is not a list of numbers (what
    a quarantined record shows), and drops it where the numbers say all."""
    raw = f"CASE WHEN embedding_numeric THEN NULL ELSE {e} END AS {e}, " if keep_raw else ""
    columns = _EMBEDDING_COLUMNS.replace("END AS embedding,", f"END AS {name},")
    return (f"SELECT * EXCLUDE (_emb_text, _emb_nums, {e}), {raw}{columns} FROM ("
            f"SELECT *, {_EMBEDDING_NUMERIC} AS embedding_numeric FROM ("
            f"SELECT *, {_EMBEDDING_NUMBERS} AS _emb_nums FROM ("
            f"SELECT *, {_embedding_text(e)} AS _emb_text FROM ({select}))))")


#: What the export road keeps of an embedding, parsed as it is read (``_insert_exports``): the
#: numbers, not the text (a 256-value list is ~3.4 KB of JSON), so a batch holds it once.
_EXPORT_EMBEDDING = {"embedding_values": "DOUBLE[]", "embedding_dim": "INTEGER", "embedding_numeric": "BOOLEAN"}


def _feature_columns(p: str, unlisted: list[str] = ()) -> str:
    """Select list mapping a feature object ``p`` (page or export row) to ``features`` columns."""
    return f"""{p}.modelId AS model_id, {p}.layer AS source_id, TRY_CAST({p}."index" AS BIGINT) AS feature_index,
               {p}.sourceSetName AS source_set_name, {p}.maxActApprox AS max_act_approx,
               {p}.frac_nonzero, {p}.pos_str, {p}.pos_values, {p}.neg_str, {p}.neg_values,
               {p}.hookName AS hook_name, {p}.hasVector AS has_vector, {p}.creatorId AS creator_id,
               {_ts(f"{p}.createdAt")} AS created_at,
               {_extra_sql(p, FEATURE_EXTRA_FIELDS, unlisted)} AS extra"""


def _activation_columns(a: str, unlisted: list[str] = ()) -> str:
    """Select list mapping an activation object ``a`` (page element or export row)."""
    return f"""{a}.id AS activation_id, {a}.modelId AS model_id, {a}.layer AS source_id,
               TRY_CAST({a}."index" AS BIGINT) AS feature_index, {a}.dataSource AS data_source,
               {a}.dataIndex AS data_index, {a}.tokens, {a}."values", {a}.maxValue AS max_value,
               {a}.maxValueTokenIndex AS max_value_token_index, {a}.minValue AS min_value,
               {a}.dfaValues AS dfa_values, {a}.dfaTargetIndex AS dfa_target_index,
               {a}.dfaMaxValue AS dfa_max_value, {a}.lossValues AS loss_values,
               {a}.logitContributions AS logit_contributions, {a}.binMin AS bin_min,
               {a}.binMax AS bin_max, {a}.binContains AS bin_contains,
               {a}.qualifyingTokenIndex AS qualifying_token_index, {a}.creatorId AS creator_id,
               {_ts(f"{a}.createdAt")} AS created_at,
               {_extra_sql(a, ACTIVATION_EXTRA_FIELDS, unlisted)} AS extra"""


def _explanation_columns(e: str, model: str, layer: str, index: str, unlisted: list[str] = (),
                         embedding: str | None = None) -> str:
    """Select list mapping an explanation object ``e``; its key falls back to its page's."""
    return f"""{e}.id AS explanation_id, coalesce({e}.modelId, {model}) AS model_id,
               coalesce({e}.layer, {layer}) AS source_id,
               coalesce(TRY_CAST({e}."index" AS BIGINT), {index}) AS feature_index,
               {e}.description, {e}.explanationModelName AS explanation_model,
               {e}.typeName AS type_name, {e}.authorId AS author_id,
               CAST({e}.scores AS VARCHAR) AS scores, {_ts(f"{e}.createdAt")} AS created_at,
               {embedding or f"{e}.embedding AS embedding_json"},
               {_extra_sql(e, EXPLANATION_EXTRA_FIELDS, unlisted)} AS extra"""


def _own_key(a: str) -> str:
    """``model/source/index`` of an object; an index that is not a number is kept as written."""
    return (f"""{a}.modelId || '/' || {a}.layer || '/' || """
            f"""coalesce(CAST(TRY_CAST({a}."index" AS BIGINT) AS VARCHAR), {a}."index", '?')""")


def _table_columns(conn: duckdb.DuckDBPyConnection, name: str) -> dict[str, str]:
    """A temp table's columns and their types, but ``input_sha256``. (``DESCRIBE`` of the one
    table: ``duckdb_columns()`` would list the lake's tables too, a catalog read.)"""
    return {c: t for c, t, *_ in conn.execute(f'DESCRIBE temp.main."{name}"').fetchall() if c != "input_sha256"}


def _export_select(table: str, unlisted: list[str] = ()) -> str:
    """SQL giving the export road's rows for a data table (bulk-export rows carry their own key);
    ``unlisted``: the fields read for ``extra`` only (``_first_line_fields``)."""
    row = f"input_sha256, {_EXPORT_ROW_BASE} + rowid AS _row"
    if table == "features":
        return f"SELECT {_feature_columns('r', unlisted)}, {row} FROM fast_export_features AS r"
    if table == "activations":
        return (f"SELECT {_activation_columns('r', unlisted)}, {row}, {_own_key('r')} AS page_key "
                "FROM fast_export_activations AS r")
    parsed = "r.embedding_values AS embedding, r.embedding_dim, r.embedding_numeric"
    return (f"SELECT {_explanation_columns('r', 'NULL', 'NULL', 'NULL', unlisted, parsed)}, {row} "
            "FROM fast_export_explanations AS r")


def _fast_select(table: str) -> str:
    """SQL giving the DuckDB road's rows for ``table``, with the same columns as the Python road."""
    if table == "features":
        return f"SELECT {_feature_columns('p')}, p.input_sha256, p._page << 20 AS _row FROM fast_pages AS p"
    if table == "activations":
        return f"""
            SELECT {_activation_columns('a')}, input_sha256, (_page << 20) + pos AS _row, page_key
            FROM (
                SELECT p.input_sha256, p._page, {_own_key('p')} AS page_key,
                       unnest(p.activations) AS a, generate_subscripts(p.activations, 1) AS pos
                FROM fast_pages AS p
            )"""
    if table == "explanations":
        return _with_embedding(f"""
            SELECT {_explanation_columns('e', 'page_model', 'page_layer', 'page_index')},
                   input_sha256, (_page << 20) + pos AS _row
            FROM (
                -- an explanation takes its page's key only when that is a feature's, as
                -- page_check._add_page: under a page with index -5 it is quarantined too
                SELECT p.input_sha256, p._page, p.modelId AS page_model, p.layer AS page_layer,
                       CASE WHEN CAST(p."index" AS BIGINT) >= 0 THEN CAST(p."index" AS BIGINT) END AS page_index,
                       unnest(p.explanations) AS e, generate_subscripts(p.explanations, 1) AS pos
                FROM fast_pages AS p
            )""", "embedding_json")
    if table == "models":
        core = ["id", "displayName", "owner", "tlensId", "layers", "dimension", "createdAt", "updatedAt"]
        return f"""
            SELECT model->>'id' AS model_id, model->>'displayName' AS display_name,
                   model->>'owner' AS owner, model->>'tlensId' AS tlens_id,
                   TRY_CAST(model->>'layers' AS INTEGER) AS n_layers,
                   TRY_CAST(model->>'dimension' AS INTEGER) AS dimension,
                   {_ts("model->>'createdAt'")} AS created_at, {_ts("model->>'updatedAt'")} AS updated_at,
                   {_drop_keys("model", core)} AS extra, input_sha256, _page << 20 AS _row
            FROM fast_pages WHERE json_type(model) = 'OBJECT'"""
    if table == "sources":
        core = ["id", "modelId", "setName", "hfRepoId", "hfFolderId", "dataset", "num_tokens_in_prompt", "createdAt"]
        return f"""
            SELECT coalesce(source->>'modelId', modelId) AS model_id, coalesce(source->>'id', '') AS source_id,
                   source->>'setName' AS source_set_name, source->>'hfRepoId' AS hf_repo_id,
                   source->>'hfFolderId' AS hf_folder_id, source->>'dataset' AS dataset,
                   TRY_CAST(source->>'num_tokens_in_prompt' AS INTEGER) AS num_tokens_in_prompt,
                   {_ts("source->>'createdAt'")} AS created_at,
                   {_drop_keys("source", core)} AS extra, input_sha256, _page << 20 AS _row
            FROM fast_pages WHERE json_type(source) = 'OBJECT'"""
    if table == "source_sets":
        core = ["modelId", "name", "description", "type", "creatorName", "releaseName", "urls", "createdAt"]
        return f"""
            SELECT coalesce(sourceSet->>'modelId', modelId) AS model_id,
                   coalesce(sourceSet->>'name', '') AS source_set_name,
                   sourceSet->>'description' AS description, sourceSet->>'type' AS type_name,
                   sourceSet->>'creatorName' AS creator_name, sourceSet->>'releaseName' AS release_name,
                   CAST(sourceSet->'urls' AS VARCHAR[]) AS urls,
                   {_ts("sourceSet->>'createdAt'")} AS created_at,
                   {_drop_keys("sourceSet", core)} AS extra, input_sha256, _page << 20 AS _row
            FROM fast_pages WHERE json_type(sourceSet) = 'OBJECT'"""
    raise ValueError(table)
