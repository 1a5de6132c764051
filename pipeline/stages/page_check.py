"""The structure of a feature page, one check on every road: a page read as JSON (every key
kept as written, ``json_view``), a key held twice anywhere refused (``repeated_key``), the page
checked against ``schemas/feature_page.schema.json`` (``check_page``), and a checked page's
records added to the parsed input (``_add_page``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple

import simdjson

from ..config import SCHEMAS_DIR
from .coerce import (
    _INT64,
    _activation,
    _explanation,
    _feature,
    _json_default,
    _model,
    _source,
    _source_set,
)
from .records import ParsedInput
from .rejected import Rejected, _json_error

__all__ = ["json_view", "repeated_key", "check_page", "import_jsonschema", "SchemaError"]

_OBJECTS = (dict, simdjson.Object)
_ARRAYS = (list, simdjson.Array)


class _Pairs(dict):
    """An object read by Python's json (``json_view``'s fallback), with its keys as written."""

    __slots__ = ("keys_written",)

    @classmethod
    def of(cls, pairs: list[tuple[str, Any]]) -> _Pairs:
        obj = cls(pairs)
        obj.keys_written = [k for k, _ in pairs]
        return obj


def json_view(data: bytes) -> Any:
    """JSON text as :func:`check_page` reads it, every key kept as written (orjson keeps the
    last of a repeated key and DuckDB's read_json the first, so both would hide a repeat).

    simdjson's view: nothing is built for what the check does not look into (the token and
    value lists), so checking a page costs a fraction of parsing it. JSON that DuckDB and
    Python's json read but simdjson does not (NaN, Infinity, 1e400, integers past 64 bits) is
    read by Python's json instead.
    """
    try:
        return simdjson.Parser().parse(data)
    except (ValueError, RuntimeError):
        try:
            return json.loads(data, object_pairs_hook=_Pairs.of)
        except (ValueError, RecursionError) as exc:
            raise _json_error(exc, "JSON input") from exc


def _keys(obj: Any) -> list[str]:
    """An object's keys as written, repeats included."""
    if type(obj) is simdjson.Object:
        return list(obj.keys())
    return obj.keys_written if type(obj) is _Pairs else list(obj)


def _repeated_key(obj: Any) -> str | None:
    keys = _keys(obj)
    if len(keys) == len(set(keys)):
        return None
    seen: set[str] = set()
    for k in keys:
        if k in seen:
            return k
        seen.add(k)
    return None


def _check_keys_once(view: Any, where: str, data: bytes) -> None:
    """Refuse JSON text ``data`` (its :func:`json_view`) when an object in it holds a key twice."""
    if (found := repeated_key(view, data)) is not None:
        raise Rejected(_twice(where, *found))


#: The opening of a JSON object with a member: ``{``, a key, its colon. A quote inside a string
#: is escaped, so a match that opens no object starts at a ``{`` that ends a string (``"{"``
#: then ``, ":``...), and no match spans the openings of two objects: a text holds at least as
#: many matches as objects that could hold a key twice.
_OBJECT_OPENING = re.compile(rb'\{\s*"[^"\\]*(?:\\.[^"\\]*)*"\s*:')
_VIEW_CONTAINERS = (simdjson.Object, _Pairs, simdjson.Array, list)


def _objects_at_most(data: bytes) -> int:
    """At least as many as the objects with a member in JSON text ``data`` (``_OBJECT_OPENING``)."""
    n, at = 0, data.find(b"{")
    while at >= 0:  # the regex at each brace, a memchr away: 0.06 ms for a 280 KB page, findall 0.2-0.4
        m = _OBJECT_OPENING.match(data, at)
        n += m is not None
        at = data.find(b"{", m.end() if m else at + 1)
    return n


def repeated_key(view: Any, data: bytes) -> tuple[str, str] | None:
    """A key that an object of ``view`` (:func:`json_view` of ``data``) holds twice, at any
    depth, and where that object is (``model.cfg``, ``activations.3``; ``""`` for the top), or
    None: orjson keeps the last copy and DuckDB's read the first, or both in a JSON column's
    text, so such a text has no one reading.

    The walk stops once it has met as many objects as ``data`` can hold (``_objects_at_most``),
    before it looks into a page's excerpts (list items, looked into last) or builds the strings
    of a list of scalars (a page's tokens: 2 ms); it looks everywhere only when objects are
    missing. A decoded flight page (a ``dict``) holds no repeat: its rows were checked as text
    (``flight._repeated_key``).
    """
    if type(view) not in _VIEW_CONTAINERS:
        return None
    # a place is (the place it is in, its key or index): no tuple is copied for each object
    fresh: list = [(view, None)]  # containers met: an object's keys are read as it is met
    shut: list = []  # objects met, whose values are still to look into ...
    items: list = []  # ... and those met as list items (a page's excerpts), looked into last
    scalar_first: list = []  # lists that begin with a scalar: looked into only if objects are missing
    met, most = 0, None
    while True:
        while fresh or shut or items:
            if fresh:
                v, at = fresh.pop()
                if type(v) is simdjson.Object or type(v) is _Pairs:
                    keys = list(v.keys()) if type(v) is simdjson.Object else v.keys_written
                    if len(keys) != len(set(keys)):
                        return _repeated_key(v), _place(at)
                    if keys:
                        met += 1
                        (items if at is not None and type(at[1]) is int else shut).append((v, keys, at))
                elif len(v):
                    if most == math.inf or type(v[0]) in _VIEW_CONTAINERS:
                        fresh.extend([(x, (at, i)) for i, x in enumerate(v) if type(x) in _VIEW_CONTAINERS])
                    else:
                        scalar_first.append((v, at))
                continue
            if most is None:
                most = _objects_at_most(data)
            if met >= most:
                return None
            v, keys, at = shut.pop() if shut else items.pop()
            for k in keys:
                x = v[k]
                if type(x) in _VIEW_CONTAINERS:
                    fresh.append((x, (at, k)))
        if most is None:
            most = _objects_at_most(data)
        if met >= most or not scalar_first:
            return None
        most = math.inf  # objects are missing: in a list that begins with a scalar, or none at all
        for v, at in scalar_first:
            if type(v) is simdjson.Array:
                try:
                    v.as_buffer(of_type="d")  # numbers only, in C
                    continue
                except (TypeError, ValueError):
                    pass
            fresh.append((v, at))
        scalar_first = []


def _place(at: tuple | None) -> str:
    """``model.cfg`` of ``((None, "model"), "cfg")``: where :func:`repeated_key` found a repeat."""
    steps = []
    while at is not None:
        at, step = at
        steps.append(str(step))
    return ".".join(reversed(steps))


def _twice(where: str, key: str, path: str) -> str:
    at = f" (in {path})" if path else ""
    return (f"{where} holds the key {key!r} twice{at}: refused, as readers disagree on which one "
            "counts (DuckDB's read_json takes the first, Python's parsers the last)")


def _show(v: Any) -> str:
    """``repr`` of a value as Python would parse it, cut to 80 characters."""
    if type(v) is simdjson.Object:
        v = v.as_dict()
    elif type(v) is simdjson.Array:
        v = v.as_list()
    text = repr(v)
    return text if len(text) <= 80 else text[:76] + " ..."


class SchemaError(ValueError):
    "The page schema uses a keyword or type the page check does not implement."


#: JSON Schema's types as Python types (and simdjson's view's); "integer" and "number" are
#: tested apart: a bool is a Python int but no JSON number, and 3.0 is a JSON Schema integer.
_PY_TYPES: dict[str, tuple[type, ...]] = {
    # a flight "$D" date is decoded to a datetime; the API sends the same value as a string
    "object": _OBJECTS, "array": _ARRAYS, "string": (str, datetime), "null": (type(None),), "boolean": (bool,),
}


def _type_test(types: list[str]) -> Callable[[Any], bool]:
    """Whether a value is of one of JSON Schema's ``types``."""
    unknown = set(types) - {*_PY_TYPES, "integer", "number"}
    if unknown:
        raise SchemaError(f"unknown type(s) {sorted(unknown)} in the page schema")
    plain = tuple(t for name in types if name in _PY_TYPES for t in _PY_TYPES[name])
    number, integer = "number" in types, "integer" in types
    if not (number or integer):
        return lambda v: isinstance(v, plain)

    def test(v: Any) -> bool:
        if isinstance(v, plain):
            return True
        if type(v) is bool:
            return False
        if isinstance(v, int):
            return True
        return isinstance(v, float) and (number or v.is_integer())
    return test


#: Keywords of the page schema the check implements; any other fails at load, never silently.
_KEYWORDS = frozenset({"$schema", "$id", "title", "description", "type", "required", "properties", "items",
                       "pattern", "minLength", "oneOf"})


class _Fault(NamedTuple):
    """Where a page departs from its schema, and what is wrong there."""

    path: tuple
    message: Callable[[], str]
    """jsonschema's words for it, made only for the fault reported."""
    repeated_key: str | None = None
    """The key an object holds twice, for that fault."""


_Check = Callable[[Any, tuple, list], None]


def _compile(schema: dict) -> _Check:
    """A check of ``schema`` (a subset of JSON Schema 2020-12, :data:`_KEYWORDS`) that appends
    every error to a list, in jsonschema's words. Each object the schema describes must hold
    each key once. Compiled once: jsonschema itself took 3 ms for a real page on simdjson's
    view (most of the DuckDB road's budget for it); this takes a tenth of that.
    """
    unknown = set(schema) - _KEYWORDS
    if unknown:
        raise SchemaError(f"the page schema uses {sorted(unknown)}, which the page check does not implement")
    checks: list[_Check] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        of_type = _type_test(types)

        def check_type(v: Any, path: tuple, errors: list) -> None:
            if not of_type(v):
                errors.append(_Fault(path, lambda: f"{_show(v)} is not of type {', '.join(map(repr, types))}"))
        checks.append(check_type)
    if "required" in schema or "properties" in schema:
        required = schema.get("required", [])
        properties = [(k, _compile(sub)) for k, sub in schema.get("properties", {}).items()]

        def check_object(v: Any, path: tuple, errors: list) -> None:
            if not isinstance(v, _OBJECTS):
                return
            key = _repeated_key(v)
            if key is not None:  # which copy the properties hold depends on the reader: stop
                errors.append(_Fault(path, lambda: "", key))
                return
            for k in required:
                if k not in v:
                    errors.append(_Fault(path, lambda k=k: f"{k!r} is a required property"))
            for k, check in properties:
                if k in v:
                    check(v[k], (*path, k), errors)
        checks.append(check_object)
    if "items" in schema:
        check_item = _compile(schema["items"])

        def check_items(v: Any, path: tuple, errors: list) -> None:
            if isinstance(v, _ARRAYS):
                for i, x in enumerate(v):
                    check_item(x, (*path, i), errors)
        checks.append(check_items)
    if "pattern" in schema:
        pattern = schema["pattern"]
        search = re.compile(pattern).search

        def check_pattern(v: Any, path: tuple, errors: list) -> None:
            if isinstance(v, datetime):
                v = _json_default(v)  # the text the API sends for it
            if isinstance(v, str) and not search(v):
                errors.append(_Fault(path, lambda: f"{_show(v)} does not match {pattern!r}"))
        checks.append(check_pattern)
    if "minLength" in schema:
        n = schema["minLength"]

        def check_length(v: Any, path: tuple, errors: list) -> None:
            if isinstance(v, datetime):
                v = _json_default(v)
            if isinstance(v, str) and len(v) < n:
                errors.append(_Fault(path, lambda: f"{_show(v)} {'should be non-empty' if n == 1 else 'is too short'}"))
        checks.append(check_length)
    if "oneOf" in schema:
        branches = [_compile(sub) for sub in schema["oneOf"]]

        def check_one_of(v: Any, path: tuple, errors: list) -> None:
            n_valid = 0
            for branch in branches:
                found: list = []
                branch(v, path, found)
                n_valid += not found
            if n_valid == 0:
                errors.append(_Fault(path, lambda: f"{_show(v)} is not valid under any of the given schemas"))
            elif n_valid > 1:
                errors.append(_Fault(path, lambda: f"{_show(v)} is valid under more than one of the given schemas"))
        checks.append(check_one_of)

    if len(checks) == 1:
        return checks[0]

    def check(v: Any, path: tuple, errors: list) -> None:
        for c in checks:
            c(v, path, errors)
    return check


#: Held while jsonschema is imported. Great Expectations' import, in its warm-up thread
#: (``validate.warm_up``), imports it too (through Altair) while this thread checks the first
#: pages: two threads importing the same packages at once can meet in Python's per-module
#: import locks, which then hand one of them a half-made module ("module 'jsonschema' has no
#: attribute 'exceptions'", seen once in the suite). Whoever comes first imports it whole.
_JSONSCHEMA_IMPORT = threading.Lock()


def import_jsonschema():
    """``jsonschema``, imported by one thread at a time (see ``_JSONSCHEMA_IMPORT``)."""
    with _JSONSCHEMA_IMPORT:
        import jsonschema
    return jsonschema


@functools.lru_cache(maxsize=1)
def _page_check() -> _Check:
    jsonschema = import_jsonschema()  # 0.08 s: only once a page is checked, not for a run that reads none

    schema = json.loads((SCHEMAS_DIR / "feature_page.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)  # a valid JSON Schema, first
    return _compile(schema)


def check_page(page: Any, where: str) -> None:
    """Check a feature page's structure before any of its records is read: the one check
    every road runs, so a page has one outcome whichever road reads it.

    ``page`` is :func:`json_view` of JSON bytes (DuckDB's road checks the page it is about to
    read, the Python road each page of its JSON input) or a decoded flight page. The structure
    is ``schemas/feature_page.schema.json``, and every object it describes must hold each key
    once. Raises :class:`Rejected` saying where the page is wrong; the shallowest fault is
    reported, as jsonschema's ``best_match`` does.
    """
    if not isinstance(page, _OBJECTS):
        kind = "list" if isinstance(page, _ARRAYS) else type(page).__name__
        raise Rejected(f"{where} is a JSON {kind}, not a feature object")
    keys = set(_keys(page))
    if "error" in keys and not {"modelId", "layer", "index"} & keys:
        raise Rejected(f"Neuronpedia answered with an error instead of a feature: {_show(page['error'])}")
    if not {"modelId", "layer", "index"} <= keys:
        raise Rejected(
            f"{where} is not a Neuronpedia feature: it lacks modelId/layer/index (its keys: "
            f"{', '.join(sorted(keys)[:8]) or 'none'})"
        )
    faults: list[_Fault] = []
    _page_check()(page, (), faults)
    if faults:
        fault = min(faults, key=lambda f: len(f.path))  # the first of the shallowest
        at = ".".join(map(str, fault.path))
        if fault.repeated_key is not None:
            raise Rejected(_twice(where, fault.repeated_key, at))
        if at == "index":
            raise Rejected(f"feature index {_show(page['index'])} is not a number")
        raise Rejected(f"{where} does not match the feature page schema at {at or '(page)'}: {fault.message()}")
    index = page["index"]
    if not -_INT64 <= int(index) < _INT64:
        raise Rejected(f"feature index {int(index)} is out of range (a feature number fits in 64 bits)")


def _add_page(parsed: ParsedInput, page: Any, where: str, view: Any = None) -> None:
    """Check a page (``view``: the same page as :func:`json_view` read it, for JSON input) and
    add its records to ``parsed``."""
    check_page(page if view is None else view, where)
    model_id, source_id = page["modelId"], page["layer"]
    index = int(page["index"])
    key = f"{model_id}/{source_id}/{index}"
    parsed.features.append(_feature(page, model_id, source_id, index))
    if isinstance(page.get("model"), dict):
        parsed.models.append(_model(page["model"]))
    if isinstance(page.get("source"), dict):
        parsed.sources.append(_source(page["source"], model_id))
    if isinstance(page.get("sourceSet"), dict):
        parsed.source_sets.append(_source_set(page["sourceSet"], model_id))
    for a in page.get("activations") or ():
        parsed.activations.append(_activation(a, key))
    # An explanation carries no feature key of its own: it takes its page's, when that is a
    # feature's (a page with index -5 has its feature and activations quarantined; without a
    # key its explanations are too, as explanation_feature_key_present).
    page_index = index if index >= 0 else None
    for e in page.get("explanations") or ():
        parsed.explanations.append(_explanation(e, model_id, source_id, page_index))
