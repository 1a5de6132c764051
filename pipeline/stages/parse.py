"""Parse stage: detect an input's shape from its content and turn it into typed records.

Shapes: API JSON (one feature object, or an array of them), the page's flight text, a saved
HTML page carrying flight chunks, bulk-export JSON lines, and any of these gzip-compressed.
Anything else is refused with :class:`Rejected`, whose message says what was wrong.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, NamedTuple

import orjson
import simdjson

from . import flight

try:  # ISA-L's gzip: the same format checks, twice as fast (a many-GB export batch is read whole once)
    from isal import igzip as _igzip
except ImportError:  # pragma: no cover - a dependency; the standard library still works
    _igzip = None
from ..config import SCHEMAS_DIR, Settings
from .records import (
    ACTIVATION_COLUMN_FIELDS,
    ACTIVATION_EXTRA_FIELDS,
    EXPLANATION_COLUMN_FIELDS,
    EXPLANATION_EXTRA_FIELDS,
    FEATURE_COLUMN_FIELDS,
    FEATURE_EXTRA_FIELDS,
    PAGE_RELATIONS,
    Activation,
    Explanation,
    Feature,
    InputFormat,
    Model,
    ParsedInput,
    Source,
    SourceSet,
    unlisted_fields,
)

__all__ = [
    "PAGE_KEY_BYTES", "Rejected", "json_text", "parse_bytes", "check_page", "json_view", "repeated_key", "gunzip_limited",
    "gunzip_measure", "open_gzip",
    "first_line",
    "first_lines",
]


class Rejected(ValueError):
    "The input is not a usable feature page; the message says why, for a person to act on."


class NotAnObject(Rejected):
    """A line of an export file that is not a JSON object (to orjson, the Python road's parser):
    ``problem`` says what it is, as the plain-lines road says it ("is not valid JSON (...)")."""

    def __init__(self, n: int, problem: str) -> None:
        super().__init__(f"line {n} {problem}")
        self.problem = problem


_GZIP_MAGIC = b"\x1f\x8b"
_WS = b" \t\r\n\xef\xbb\xbf"


def _fmt_bytes(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _gunzip_chunks(data: bytes, limit: int) -> Iterator[bytes]:
    """Decompress gzip bytes (all members) in chunks of at most 1 MiB, refusing to produce more
    than ``limit`` bytes in all; raises :class:`Rejected` for corrupt or truncated input."""
    produced = 0
    rest = data
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            while not d.eof:
                chunk = d.decompress(rest, 1 << 20)
                rest = d.unconsumed_tail
                if not chunk and not rest:
                    break  # input used up before the stream's end marker
                produced += len(chunk)
                if produced > limit:
                    raise Rejected(
                        f"gzip input expands past the {_fmt_bytes(limit)} limit "
                        "(FEATUREHOUSE_MAX_DECOMPRESSED_BYTES); refused as a possible gzip bomb"
                    )
                yield chunk
        except zlib.error as exc:
            raise Rejected(f"gzip data is corrupt ({exc}); re-download or re-export the file") from exc
        if not d.eof:
            raise Rejected(
                f"gzip stream is truncated: it ended after {_fmt_bytes(produced)} of output "
                "without its end marker; the file was cut short in transfer"
            )
        rest = d.unused_data.lstrip(b"\x00")
        if rest and not rest.startswith(_GZIP_MAGIC):
            raise Rejected("gzip file has trailing bytes that are not another gzip member")


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Decompress gzip bytes (all members), refusing to produce more than ``limit`` bytes."""
    return b"".join(_gunzip_chunks(data, limit))


#: Keys only a whole feature page has, as they appear in its JSON (the unescaped quote before the
#: colon cannot occur inside a string value): an export file holding one is refused.
PAGE_KEY_BYTES = (b'"activations":', b'"explanations":')


def open_gzip(path: Path) -> IO[bytes]:
    """A local gzip file as a binary stream, with ISA-L's gzip where installed."""
    return (_igzip or gzip).open(path, "rb")


def gunzip_measure(path: Path | IO[bytes], limit: int, refuse_keys: tuple[bytes, ...] = (),
                   lines: Any = None) -> tuple[int, int]:
    """The decompressed size and line count of a gzip file, checked whole (CRC, end marker)
    and within ``limit``, streamed 1 MiB at a time: memory stays flat however large the file.
    A line holding one of ``refuse_keys`` refuses the file (:data:`PAGE_KEY_BYTES`: pages in a
    file of export rows, which the export road would read as rows, dropping the pages' records).
    ``lines`` (a ``stage.LineCheck``) is fed the decompressed bytes as they come.

    Read with ISA-L's gzip (python-isal: 3.3 s for a 1 GiB export batch against 6.3 s with the
    standard library); a file it finds broken is read again with the standard library, whose
    errors name the fault precisely (cut short, bad CRC, trailing bytes).
    """
    seekable = not hasattr(path, "read") or path.seekable()  # type: ignore[union-attr]
    if _igzip is not None and seekable:
        try:
            return _measure(_igzip, path, limit, [0], refuse_keys, lines)
        except Rejected:
            raise
        except Exception:  # noqa: BLE001 - diagnosed below, by the standard library
            if hasattr(path, "seek"):
                path.seek(0)  # type: ignore[union-attr]
    produced = [0]
    try:
        return _measure(gzip, path, limit, produced, refuse_keys, lines)
    except EOFError as exc:
        raise Rejected(
            f"gzip stream is truncated: it ended after {_fmt_bytes(produced[0])} of output "
            "without its end marker; the file was cut short in transfer"
        ) from exc
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise Rejected(f"gzip data is corrupt ({exc}); re-download or re-export the file") from exc


def _measure(module: Any, path: Path | IO[bytes], limit: int, produced: list[int],
             refuse_keys: tuple[bytes, ...] = (), check: Any = None) -> tuple[int, int]:
    if check is not None:
        check.reset()  # a second try (ISA-L found the file broken) starts afresh
    lines = 0
    carry = b""  # the end of the last chunk: a key may straddle two
    with module.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if refuse_keys:
                width = max(map(len, refuse_keys)) - 1
                for key in refuse_keys:
                    # across the seam with the last chunk first (a few bytes), then this chunk
                    seam = carry + chunk[:width]
                    at = seam.find(key)
                    if at >= 0:
                        line = lines - carry.count(b"\n") + seam.count(b"\n", 0, at) + 1
                    elif (at := chunk.find(key)) >= 0:
                        line = lines + chunk.count(b"\n", 0, at) + 1
                    if at >= 0:
                        raise Rejected(
                            f"line {line} holds a whole feature page ({key.decode()[:-1]} key) but the file's "
                            "first line is a bulk-export row: send feature pages and bulk-export rows in "
                            "separate files"
                        )
                carry = chunk[-width:]
            produced[0] += len(chunk)
            lines += chunk.count(b"\n")
            if check is not None and produced[0] <= limit:
                check.feed(chunk)
            if produced[0] > limit:
                raise Rejected(
                    f"gzip input expands past the {_fmt_bytes(limit)} limit "
                    "(FEATUREHOUSE_MAX_DECOMPRESSED_BYTES); refused as a possible gzip bomb"
                )
    return produced[0], lines


def first_line(data: bytes, limit: int = 1 << 20) -> bytes | None:
    """The first line of gzip ``data`` (decompressing at most ``limit`` bytes), or None."""
    lines = first_lines(data, limit)
    return lines[0] if lines else None


def first_lines(data: bytes, limit: int = 1 << 20) -> list[bytes]:
    """The whole lines at the start of gzip ``data`` (decompressing at most ``limit`` bytes)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        head = d.decompress(data, limit)
    except zlib.error:
        return []
    lines = head.split(b"\n")
    if not d.eof:
        lines.pop()  # cut at the limit
    elif not lines[-1]:
        lines.pop()
    return lines


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejected(
            f"{what} is not valid UTF-8 (bad byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "it may be in another encoding or binary"
        ) from exc


def _json_error(exc: Exception, what: str) -> Rejected:
    msg = str(exc)
    if "recursion" in msg.lower() or "depth limit" in msg.lower():  # orjson's words for it
        return Rejected(f"{what} is nested deeper than 1024 levels; refused rather than parsed")
    if "unexpected end of data" in msg.lower() or "EOF" in msg:
        return Rejected(f"{what} is truncated: {msg}")
    return Rejected(f"{what} is not valid JSON: {msg}")


def parse_bytes(data: bytes, settings: Settings | None = None) -> ParsedInput:
    """Detect the shape of ``data`` from its content and parse it into records.

    Raises :class:`Rejected` with a reason a person can act on when the input is not a feature
    page or is broken. Gzip is undone first, within ``settings.max_decompressed_bytes``.
    """
    settings = settings or Settings()
    prefix = ""
    for _ in range(3):
        if not data.startswith(_GZIP_MAGIC):
            break
        data = gunzip_limited(data, settings.max_decompressed_bytes)
        prefix = "gzip+"
    body = data.lstrip(_WS)
    if not body:
        raise Rejected("input is empty" + (" after gunzip" if prefix else "") + ": there is nothing to parse")
    head = body[:1]
    if head in (b"{", b"["):
        parsed = _parse_json(body)
    elif b"self.__next_f.push(" in body:
        parsed = _parse_html(body, settings)
    elif flight.looks_like_flight(body):
        parsed = _parse_flight(body, settings)
    elif body[:200].lower().lstrip().startswith((b"<!doctype", b"<html")):
        raise Rejected(
            "HTML page without Neuronpedia's __next_f flight data: not a saved feature page "
            "(save the page after it has loaded, or fetch it through the API)"
        )
    else:
        _utf8(body, "input")  # say so when it is not text at all (UTF-16, binary)
        # its first characters, to recognise it by: anything but printable ASCII escaped, so
        # that a terminal shows no stranger's text (the bundled spam sample's, say) as written
        sample = body[:40].decode("utf-8", "ignore").replace("\n", " ")
        raise Rejected(
            "not a Neuronpedia feature page: it is neither JSON, flight text nor a saved "
            f"Neuronpedia HTML page (it starts with {ascii(sample)})"
        )
    parsed.format = InputFormat(parsed.format)
    if prefix:
        parsed.format = f"{prefix}{parsed.format.value}"  # type: ignore[assignment]
    return parsed


def _first_line_is_object(body: bytes) -> bool:
    end = body.find(b"\n")
    if end < 0:
        return False
    try:
        return isinstance(orjson.loads(body[:end]), dict)
    except orjson.JSONDecodeError:
        return False


def _parse_json(body: bytes) -> ParsedInput:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        msg = str(exc).lower()  # orjson ≥ 3.10 says "unexpected content after document"
        if body[:1] == b"{" and b"\n" in body.rstrip(_WS) and ("trailing" in msg or "after document" in msg):
            return _parse_jsonl(body)
        if body[:1] == b"{" and "utf-8" in msg and _first_line_is_object(body):
            return _parse_jsonl(body)  # JSON lines with a byte that is not UTF-8: that line is bad
        _utf8(body, "JSON input")
        raise _json_error(exc, "JSON input") from exc
    if isinstance(obj, dict) and (
        not {"modelId", "layer", "index"} <= obj.keys() or {"tokens", "values", "description"} & obj.keys()
    ):
        # A one-line export file (model.jsonl, source.jsonl, a one-row activations batch) is
        # also one JSON object: read it as an export row when it is one.
        try:
            return _parse_jsonl(body)
        except Rejected:
            pass
    parsed = ParsedInput(InputFormat.API_JSON)
    view = json_view(body)  # the bytes as the structural check reads them, every key kept
    # an object anywhere holding a key twice refuses the input, as on DuckDB's road
    # (stage.exact_activations) and in flight text; the pages are then read from what orjson kept
    _check_keys_once(view, "JSON input", body)
    if isinstance(obj, dict) and "features" in obj and isinstance(obj["features"], list):
        obj, view = obj["features"], view["features"]
    pages = obj if isinstance(obj, list) else [obj]
    views = list(view) if isinstance(obj, list) else [view]
    if not pages:
        raise Rejected("JSON array holds no features")
    for i, (page, page_view) in enumerate(zip(pages, views, strict=True)):
        where = "JSON input" if len(pages) == 1 else f"item {i} of the JSON array"
        _add_page(parsed, page, where, page_view)
    return parsed


def _parse_flight(body: bytes, settings: Settings) -> ParsedInput:
    try:
        rows = flight.parse_rows(body)
        limit = min(flight.expansion_limit(rows), settings.max_decompressed_bytes)
        found, page = flight.find_key(rows, "initialNeuron", max_units=limit)
    except flight.ExpansionError as exc:
        if limit < flight.expansion_limit(rows):
            bound = f"the limit: FEATUREHOUSE_MAX_DECOMPRESSED_BYTES, {limit:,}"
        else:
            bound = (f"the limit: {flight.MAX_EXPANSION}× the text's {len(body):,} bytes, "
                     f"at least {flight.MIN_EXPANSION_LIMIT:,}")
        raise Rejected(
            f"flight text refused as a reference bomb: its {exc} ({bound}; a real page's references "
            "do not repeat rows like that)"
        ) from exc
    except flight.FlightError as exc:
        raise Rejected(f"flight text is broken: {exc}") from exc
    except (orjson.JSONDecodeError, RecursionError) as exc:
        raise _json_error(exc, "flight row") from exc
    if not found:
        raise Rejected(
            f"flight text with {len(rows)} row(s) carries no initialNeuron: not a feature page "
            "(was another Neuronpedia page saved?)"
        )
    if page is None:
        raise Rejected("the page's initialNeuron is empty: Neuronpedia has no such feature")
    parsed = ParsedInput(InputFormat.FLIGHT)
    _add_page(parsed, page, "initialNeuron")
    return parsed


def _parse_html(body: bytes, settings: Settings) -> ParsedInput:
    html = _utf8(body, "HTML page")
    try:
        text = flight.html_to_flight(html)
    except flight.FlightError as exc:
        raise Rejected(f"saved HTML page is broken: {exc}") from exc
    except RecursionError as exc:
        raise Rejected("saved HTML page has a __next_f chunk nested too deep to parse; refused") from exc
    if not text.strip():
        raise Rejected("saved HTML page has __next_f chunks but no flight text in them")
    parsed = _parse_flight(text, settings)
    parsed.format = InputFormat.HTML
    return parsed


# --- the structure of a page: one check, every road ------------------------------------

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


# --- bulk export JSON lines -------------------------------------------------------------


#: Keys only a whole feature page has (an export row never does).
_PAGE_KEYS = frozenset({"activations", "explanations", "model", "source", "sourceSet"})


def _parse_jsonl(body: bytes) -> ParsedInput:
    """JSON lines: bulk-export rows, or whole feature pages one per line (each a page, with its
    activations and explanations); a file mixing the two is refused.

    In a file of export rows, a line that is no record (not JSON, not an object, a key written
    twice, an index that is no integer) is set aside in ``bad_lines`` and the rest of the file
    is read, as DuckDB's export road does; more than ``MAX_BAD_LINES`` such lines refuse it."""
    parsed = ParsedInput(InputFormat.EXPORT_JSONL)
    first_kind: tuple[int, str] | None = None
    first_error: Rejected | None = None
    # JSON lines end at "\n" (a "\r" before it, or inside a line, is whitespace to JSON, as
    # to DuckDB's reader); splitlines() would also cut a line at a bare "\r" or "\x1c".
    for n, line in enumerate(body.split(b"\n"), start=1):
        _refuse_past_the_limit(parsed)
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            error = _json_error(exc, f"line {n} of the JSON lines")
            if first_kind is not None and first_kind[1] == "a whole feature page":
                raise error from exc
            first_error = first_error or error
            parsed.bad_lines.append((n, _kept(line), _bad_json(line, exc), False))
            continue
        if not isinstance(row, dict):
            if first_kind is not None and first_kind[1] == "a whole feature page":
                raise Rejected(f"line {n} of the JSON lines is not an object")
            first_error = first_error or Rejected(f"line {n} of the JSON lines is not an object")
            parsed.bad_lines.append((n, _kept(line), f"is {_json_kind(row)}, not a JSON object", False))
            continue
        kind = "a whole feature page" if _PAGE_KEYS & row.keys() else "an export row"
        if first_kind is None:
            first_kind = (n, kind)
            if kind == "a whole feature page":
                if parsed.bad_lines:  # a file of pages is read whole or refused, as before
                    raise first_error  # type: ignore[misc]
                parsed.format = InputFormat.API_JSON
        elif kind != first_kind[1]:
            raise Rejected(
                f"line {n} of the JSON lines is {kind} but line {first_kind[0]} is {first_kind[1]}: "
                "send feature pages and bulk-export rows in separate files"
            )
        if kind == "a whole feature page":
            view = json_view(line)
            _add_page(parsed, row, f"line {n} of the JSON lines", view)
            _check_keys_once(view, f"line {n} of the JSON lines", line)
            continue
        try:
            _check_keys_once(json_view(line), f"line {n}", line)
            _add_export_row(parsed, row, n)
        except Rejected as exc:
            parsed.bad_lines.append((n, _kept(line), str(exc).removeprefix(f"line {n}: ").removeprefix(f"line {n} "), True))
    _refuse_past_the_limit(parsed)
    if first_kind is None and first_error is not None:
        raise first_error  # no line is a record: not an export file with bad lines
    if parsed.bad_lines and not any(getattr(parsed, t) for t in
                                    ("models", "source_sets", "sources", "features", "activations", "explanations")):
        n0, _, problem, _ = parsed.bad_lines[0]  # nothing of it is a record: refused, with the first reason
        raise Rejected(f"line {n0}: {problem}" if parsed.bad_lines[0][3] else f"line {n0} of the JSON lines {problem}")
    if parsed.bad_lines and first_kind is not None:
        parsed.bad_lines = _merge_lines(parsed.bad_lines)
    return parsed


#: An export file with more lines that are no records than this is refused whole (as
#: ``stage.MAX_BAD_LINES`` on the export road).
MAX_BAD_LINES = 1000
_KEPT_BYTES = 1 << 16


def _refuse_past_the_limit(parsed: ParsedInput) -> None:
    """Every line that is no record counts (not JSON, not an object, a bad index), as on the
    export road (``stage.MAX_BAD_LINES``)."""
    if len(parsed.bad_lines) > MAX_BAD_LINES:
        n0, _, problem, _ = parsed.bad_lines[0]
        raise Rejected(f"more than {MAX_BAD_LINES:,} of its lines are no records (the first: line {n0} "
                       f"{problem}); refused whole: it is not a readable export batch")


def _json_kind(v: Any) -> str:
    return ("an array" if isinstance(v, list) else "a string" if isinstance(v, str) else
            "null" if v is None else "a boolean" if isinstance(v, bool) else "a number")


def _kept(line: bytes) -> str:
    text = line[:_KEPT_BYTES].decode("utf-8", "replace")
    return text + (f"… ({len(line):,} bytes in all)" if len(line) > _KEPT_BYTES else "")


def _bad_json(line: bytes, exc: Exception) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"is not valid UTF-8 (byte 0x{line[bad.start]:02x} at offset {bad.start})"
    return f"is not valid JSON ({str(exc).split(':')[0]})"


def _merge_lines(bad: list[tuple[int, str, str, bool]]) -> list[tuple[int, str, str, bool]]:
    """Runs of consecutive bad lines that together hold one JSON object, made one (as
    ``stage.merge_objects``)."""
    out: list[tuple[int, str, str, bool]] = []
    i = 0
    while i < len(bad):
        j = i
        if not bad[i][3] and bad[i][1].lstrip().startswith("{"):
            while j + 1 < len(bad) and bad[j + 1][0] == bad[j][0] + 1 and not bad[j][1].rstrip().endswith("}"):
                j += 1
            if j > i:
                text = "\n".join(b[1] for b in bad[i:j + 1])
                try:
                    whole = type(orjson.loads(text)) is dict
                except orjson.JSONDecodeError:
                    whole = False
                if whole:
                    out.append((bad[i][0], text[:_KEPT_BYTES], f"is the first of lines {bad[i][0]}–{bad[j][0]}, one "
                                f"JSON object written over {j - i + 1} lines, not one line (JSON lines hold an "
                                "object a line)", False))
                    i = j + 1
                    continue
        out.append(bad[i])
        i += 1
    return out


def _export_key(row: dict, n: int) -> tuple[str | None, str | None, int | None]:
    index = row.get("index")
    if index is None:
        return row.get("modelId"), row.get("layer"), None
    if isinstance(index, float) and not index.is_integer():
        raise Rejected(f"line {n}: feature index {index!r} is not a whole number")
    # as parse._int: a number, or ASCII digits ("2_004", " 12" and "1904.0" are no integers)
    if type(index) is bool or not (isinstance(index, (int, float)) or (isinstance(index, str) and _DIGITS.fullmatch(index))):
        raise Rejected(f"line {n}: feature index {index!r} is not a number")
    idx = int(index)
    if not -_INT64 <= idx < _INT64:
        raise Rejected(f"line {n}: feature index {index!r} is out of range")
    return row.get("modelId"), row.get("layer"), idx


def parse_export_line(line: bytes, n: int) -> ParsedInput:
    """Line ``n`` of a bulk-export file, read as the Python road reads it (a line DuckDB's typed
    read would take otherwise: ``stage.LineCheck``). Raises :class:`Rejected` for a line that is
    no record: not a JSON object, a key written twice, an index that is not an integer."""
    where = f"line {n}"
    try:  # what the plain-lines road says of a line that is no JSON object
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise NotAnObject(n, _bad_json(line, exc)) from exc
    if not isinstance(row, dict):
        raise NotAnObject(n, f"is {_json_kind(row)}, not a JSON object")
    _check_keys_once(json_view(line), where, line)
    parsed = ParsedInput(InputFormat.EXPORT_JSONL)
    _add_export_row(parsed, row, n)
    return parsed


def _add_export_row(parsed: ParsedInput, row: dict, n: int) -> None:
    keys = row.keys()
    if "tokens" in keys or "values" in keys:
        model_id, source_id, idx = _export_key(row, n)
        parsed.activations.append(_activation(row, None))
    elif "description" in keys and "layer" in keys:
        model_id, source_id, idx = _export_key(row, n)
        parsed.explanations.append(_explanation(row, model_id, source_id, idx))
    elif "layer" in keys and "index" in keys:
        model_id, source_id, idx = _export_key(row, n)
        parsed.features.append(_feature(row, model_id, source_id, idx))
    elif "setName" in keys and "id" in keys:
        parsed.sources.append(_source(row, row.get("modelId")))
    elif "name" in keys and "modelId" in keys:
        parsed.source_sets.append(_source_set(row, row["modelId"]))
    elif "id" in keys and ({"displayName", "layers", "tlensId", "owner"} & keys):
        parsed.models.append(_model(row))
    else:
        raise Rejected(
            f"line {n} is neither a feature, activation, explanation, model, source nor "
            f"source-set row (its keys: {', '.join(sorted(keys)[:8])})"
        )


# --- field coercion ---------------------------------------------------------------------


def _ts(v: Any) -> datetime | None:
    if isinstance(v, datetime):
        dt = v
    elif isinstance(v, str) and v:
        s = v[2:] if v.startswith("$D") else v
        try:
            dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            return None
    else:
        return None
    if dt.tzinfo is not None:
        dt = dt.astimezone(timezone.utc).replace(tzinfo=None)
    return dt


def _num(v: Any) -> float | None:
    t = type(v)
    if t is float:
        return v
    if t is int:
        try:
            return float(v)
        except OverflowError:  # a "$n" bigint past the float range
            return math.nan
    if isinstance(v, str) and v in ("$I", "$Infinity", "$-Infinity", "$N", "$NaN"):
        return {"$I": math.inf, "$Infinity": math.inf, "$-Infinity": -math.inf}.get(v, math.nan)
    return None


_INT64 = 2**63
_INT32 = 2**31


#: An integer written as text: ASCII digits only (``str.isdigit`` also takes "²", which ``int()``
#: then refuses, and Arabic-Indic digits, which it reads; DuckDB's cast refuses both). DuckDB's
#: cast is laxer still ("+12", " 12", "1_2", "0x1", "12.5" read as numbers): an activation's
#: ``index`` written so is quarantined on both roads, with one check more on this one.
_DIGITS = re.compile(r"-?[0-9]+")


def _int(v: Any, bound: int = _INT64) -> int | None:
    """An integer, or None when it is not one or does not fit its column (BIGINT by default)."""
    if type(v) is int:
        n = v
    elif isinstance(v, float) and v.is_integer():
        n = int(v)
    elif isinstance(v, str) and _DIGITS.fullmatch(v):
        n = int(v)
    else:
        return None
    # A value its column cannot hold would make the Arrow conversion, and so the run, fail.
    return n if -bound <= n < bound else None


def _int32(v: Any) -> int | None:
    return _int(v, _INT32)


_NUMBER_TYPES = {float, int}


def _floats(v: Any) -> list[float] | None:
    """A list of numbers; elements that are not numbers become null, as DuckDB's typed read makes
    them (validation refuses them: values_not_null)."""
    if not isinstance(v, list):
        return None
    types = set(map(type, v))
    if types <= _NUMBER_TYPES and (int not in types or -_INT64 <= min(v) and max(v) < _INT64):
        return v  # the common case: leave the list as parsed (Arrow converts ints that fit int64)
    return [_num(x) for x in v]


def _strs(v: Any) -> list[str] | None:
    if not isinstance(v, list):
        return None
    return [x if type(x) is str else _str(x) for x in v]


def _str(v: Any) -> str | None:
    """Text as DuckDB's typed read of the same JSON makes it, so both roads store one thing: a
    string as is, ``true``/``false``, a number as DuckDB (and Python's ``repr``) writes it, an
    object or a list as its compact JSON, a flight ``$D`` date as the API writes dates; null
    stays null (an excerpt token that is null is refused by ``tokens_not_null``)."""
    if v is None or isinstance(v, str):
        return v
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, datetime):
        return _json_default(v)
    return _json(v)


def _json_default(v: Any) -> Any:
    if isinstance(v, datetime):
        # Written as the API writes dates (JavaScript's toISOString), so that a flight "$D" date
        # in an extra field stores the same text as the API JSON's string.
        if v.tzinfo is not None:
            v = v.astimezone(timezone.utc).replace(tzinfo=None)
        frac = f"{v.microsecond // 1000:03d}" if v.microsecond % 1000 == 0 else f"{v.microsecond:06d}"
        return v.strftime("%Y-%m-%dT%H:%M:%S.") + frac + "Z"
    return str(v)


def _json(v: Any) -> str | None:
    """JSON text of a parsed value; a flight ``$D`` date as the API writes it."""
    if v is None:
        return None
    return orjson.dumps(
        v, default=_json_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
    ).decode()


_FEATURE_RELATIONS = {"model", "source", "sourceSet", "activations", "explanations", "lists", "creator", "comments"}


def _extra(obj: dict, columns: frozenset[str], listed: tuple[str, ...]) -> str:
    """``obj``'s fields that have no column: the listed ones (null when absent), then any
    other that is not null, by name (as columns.py's ``_extra_sql`` builds it)."""
    extra = {k: obj.get(k) for k in listed}
    for k in unlisted_fields(obj.keys(), columns, listed):
        if obj[k] is not None:
            extra[k] = obj[k]
    return _json(extra)


def _embedding(v: Any) -> tuple[list[float] | None, int | None, bool | None]:
    """An explanation's embedding (a JSON list, or a string holding one): the numbers, how many
    values it holds, and whether they are all finite numbers (see ``columns._EMBEDDING_NUMERIC``)."""
    if v is None:
        return None, None, None
    if isinstance(v, str):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError:
            return None, None, False
    if not isinstance(v, list):
        return None, None, False
    numeric = all((type(x) is int or type(x) is float) and math.isfinite(x) for x in v)
    return ([float(x) for x in v] if numeric else None), len(v), numeric


def _feature(p: dict, model_id: Any, source_id: Any, index: int | None) -> Feature:
    return Feature(
        model_id=_str(model_id),
        source_id=_str(source_id),
        feature_index=index,
        source_set_name=_str(p.get("sourceSetName")),
        max_act_approx=_num(p.get("maxActApprox")),
        frac_nonzero=_num(p.get("frac_nonzero")),
        pos_str=_strs(p.get("pos_str")),
        pos_values=_floats(p.get("pos_values")),
        neg_str=_strs(p.get("neg_str")),
        neg_values=_floats(p.get("neg_values")),
        hook_name=_str(p.get("hookName")),
        has_vector=p.get("hasVector") if isinstance(p.get("hasVector"), bool) else None,
        creator_id=_str(p.get("creatorId")),
        created_at=_ts(p.get("createdAt")),
        extra=_extra({k: v for k, v in p.items() if k not in PAGE_RELATIONS},
                     FEATURE_COLUMN_FIELDS, FEATURE_EXTRA_FIELDS),
        raw={k: v for k, v in p.items() if k not in _FEATURE_RELATIONS},
    )


def _activation(a: Any, page_key: str | None) -> Activation:
    if not isinstance(a, dict):
        a = {"value": a}
    model_id, source_id, idx = a.get("modelId"), a.get("layer"), _int(a.get("index"))
    key = f"{model_id}/{source_id}/{idx}"
    return Activation(
        activation_id=_str(a.get("id")) or None,
        model_id=_str(model_id),
        source_id=_str(source_id),
        feature_index=idx,
        data_source=_str(a.get("dataSource")),
        data_index=_str(a.get("dataIndex")),
        tokens=_strs(a.get("tokens")),
        values=_floats(a.get("values")),
        max_value=_num(a.get("maxValue")),
        max_value_token_index=_int32(a.get("maxValueTokenIndex")),
        min_value=_num(a.get("minValue")),
        dfa_values=_floats(a.get("dfaValues")),
        dfa_target_index=_int32(a.get("dfaTargetIndex")),
        dfa_max_value=_num(a.get("dfaMaxValue")),
        loss_values=_floats(a.get("lossValues")),
        logit_contributions=(
            a["logitContributions"] if isinstance(a.get("logitContributions"), str)
            else _json(a.get("logitContributions"))
        ),
        bin_min=_num(a.get("binMin")),
        bin_max=_num(a.get("binMax")),
        bin_contains=_num(a.get("binContains")),
        qualifying_token_index=_int32(a.get("qualifyingTokenIndex")),
        creator_id=_str(a.get("creatorId")),
        created_at=_ts(a.get("createdAt")),
        extra=_extra(a, ACTIVATION_COLUMN_FIELDS, ACTIVATION_EXTRA_FIELDS),
        page_key=page_key if page_key is not None else key,
        raw=a,
    )


def _explanation(e: Any, model_id: Any, source_id: Any, index: int | None) -> Explanation:
    if not isinstance(e, dict):
        e = {"value": e}
    embedding, dim, numeric = _embedding(e.get("embedding"))
    return Explanation(
        explanation_id=_str(e.get("id")) or None,
        model_id=_str(e.get("modelId", model_id)),
        source_id=_str(e.get("layer", source_id)),
        feature_index=_int(e["index"]) if "index" in e else index,
        description=_str(e.get("description")),
        explanation_model=_str(e.get("explanationModelName")),
        type_name=_str(e.get("typeName")),
        author_id=_str(e.get("authorId")),
        scores=_json(e.get("scores")),
        created_at=_ts(e.get("createdAt")),
        embedding=embedding,
        extra=_extra(e, EXPLANATION_COLUMN_FIELDS, EXPLANATION_EXTRA_FIELDS),
        embedding_dim=dim,
        embedding_numeric=numeric,
        raw=e,
    )


def _model(m: dict) -> Model:
    core = {"id", "displayName", "owner", "tlensId", "layers", "dimension", "createdAt", "updatedAt"}
    return Model(
        model_id=_str(m.get("id")) or "",
        display_name=_str(m.get("displayName")),
        owner=_str(m.get("owner")),
        tlens_id=_str(m.get("tlensId")),
        n_layers=_int32(m.get("layers")),
        dimension=_int32(m.get("dimension")),
        created_at=_ts(m.get("createdAt")),
        updated_at=_ts(m.get("updatedAt")),
        extra=_json({k: v for k, v in m.items() if k not in core}),
    )


def _source(s: dict, model_id: Any) -> Source:
    core = {"id", "modelId", "setName", "hfRepoId", "hfFolderId", "dataset", "num_tokens_in_prompt", "createdAt"}
    return Source(
        model_id=_str(s.get("modelId", model_id)) or "",
        source_id=_str(s.get("id")) or "",
        source_set_name=_str(s.get("setName")),
        hf_repo_id=_str(s.get("hfRepoId")),
        hf_folder_id=_str(s.get("hfFolderId")),
        dataset=_str(s.get("dataset")),
        num_tokens_in_prompt=_int32(s.get("num_tokens_in_prompt")),
        created_at=_ts(s.get("createdAt")),
        extra=_json({k: v for k, v in s.items() if k not in core}),
    )


def _source_set(s: dict, model_id: Any) -> SourceSet:
    core = {"modelId", "name", "description", "type", "creatorName", "releaseName", "urls", "createdAt"}
    return SourceSet(
        model_id=_str(s.get("modelId", model_id)) or "",
        source_set_name=_str(s.get("name")) or "",
        description=_str(s.get("description")),
        type_name=_str(s.get("type")),
        creator_name=_str(s.get("creatorName")),
        release_name=_str(s.get("releaseName")),
        urls=_strs(s.get("urls")),
        created_at=_ts(s.get("createdAt")),
        extra=_json({k: v for k, v in s.items() if k not in core}),
    )


json_text = _json
