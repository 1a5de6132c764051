"""Parse stage: detect an input's shape from its content and turn it into typed records.

Shapes: API JSON (one feature object, or an array of them), the page's flight text, a saved
HTML page carrying flight chunks, bulk-export JSON lines, and any of these gzip-compressed.
Anything else is refused with :class:`Rejected`, whose message says what was wrong.

This module detects the shape and reads a page (API JSON, flight text, a saved HTML page, gzip
of them); the rest of the stage is in rooms of one concern each: ``rejected.py`` (the refusals),
``gunzip.py`` (gzip within limits), ``page_check.py`` (a page's structure, checked on every
road), ``export_parse.py`` (bulk-export JSON lines) and ``coerce.py`` (fields coerced into typed
records). Every name other code imports from here is re-exported.
"""

from __future__ import annotations

import orjson

from ..config import Settings
from . import flight
from .coerce import json_text
from .export_parse import _parse_jsonl, parse_export_line
from .gunzip import (
    _GZIP_MAGIC,
    PAGE_KEY_BYTES,
    first_line,
    first_lines,
    gunzip_limited,
    gunzip_measure,
    open_gzip,
)
from .page_check import (
    SchemaError,
    _add_page,
    _check_keys_once,
    check_page,
    import_jsonschema,
    json_view,
    repeated_key,
)
from .records import InputFormat, ParsedInput
from .rejected import NotAnObject, Rejected, _json_error, _utf8

__all__ = [
    "PAGE_KEY_BYTES", "Rejected", "NotAnObject", "json_text", "parse_bytes", "parse_export_line", "check_page",
    "json_view", "repeated_key", "import_jsonschema", "SchemaError", "gunzip_limited", "gunzip_measure",
    "open_gzip", "first_line", "first_lines",
]

_WS = b" \t\r\n\xef\xbb\xbf"


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
