"""Decode React Server Components "flight" text, raw or inside a saved HTML page.

A flight payload is a sequence of rows ``<hex id>:<payload>``. Most payloads are one line
of JSON; tagged rows (``I``, ``HL``, ``E`` ...) are not JSON; ``T<hex len>,<text>`` rows carry
long strings whose length is counted in UTF-8 bytes with no newline after them. Inside row
JSON, strings that start with ``$`` are encodings (see React's ``parseModelString``).
Written by hand because no maintained Python library reads flight text.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import orjson

__all__ = [
    "FlightError", "ExpansionError", "Rows", "parse_rows", "decode", "find_key", "expansion_limit",
    "html_to_flight", "looks_like_flight", "MAX_EXPANSION", "MIN_EXPANSION_LIMIT",
]


class FlightError(ValueError):
    "The flight text is malformed; the message says where."


class ExpansionError(FlightError):
    "Row references expand the text past its limit (a reference bomb)."


#: A decoded value may hold at most this many times as many values and characters as the text
#: has bytes. Without references a value holds fewer than its text's bytes (each value, key
#: character and string character takes at least one byte), so only references that repeat a row
#: can reach it: 35 rows each referring twice to the one before expand to 2 ** 35 values.
MAX_EXPANSION = 4
#: ... and at least this many, whatever the text's size.
MIN_EXPANSION_LIMIT = 1 << 20


class Rows(dict):
    """A flight text's rows by id (what :func:`parse_rows` returns), and the text's size, which
    bounds how far references may expand what is decoded from them."""

    n_bytes: int = 0


def expansion_limit(rows: dict[str, Any]) -> int:
    """How many values and characters a value decoded from ``rows`` may hold written out in full."""
    return max(MAX_EXPANSION * getattr(rows, "n_bytes", 0), MIN_EXPANSION_LIMIT)


_ROW_ID = re.compile(rb"([0-9a-fA-F]{1,8}):")
_HEX = re.compile(r"[0-9a-f]+")
# Row tags followed by "<hex length>," and that many bytes (text and binary typed arrays).
_LENGTH_PREFIXED = frozenset(b"TABOoUSsLlGgMmV")
_JSON_START = frozenset(b'[{"-0123456789tfn')
_UNDEFINED = object()
_SCALARS = frozenset({int, float, bool, type(None), datetime})


def looks_like_flight(data: bytes) -> bool:
    """True when the bytes start with a flight row (``<hex id>:`` then a payload)."""
    m = _ROW_ID.match(data.lstrip(b"\xef\xbb\xbf"))
    return bool(m) and len(data) > m.end()


class _Repeated(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_repeats(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _Repeated(key)
        seen.add(key)


def _repeated_key(payload: bytes) -> str | None:
    """A key some object of a JSON row holds twice (orjson kept the last one silently; the same
    page as JSON is refused for it), or None. Python's parser, keeping no object: ~1 ms per 100 KB."""
    if b'":' not in payload:
        return None
    try:
        json.loads(payload, object_pairs_hook=_no_repeats)
    except _Repeated as r:
        return r.key
    except (ValueError, RecursionError):
        return None  # orjson read it: what it read stands
    return None


def parse_rows(data: bytes) -> Rows:
    """Split flight bytes into ``{row id: raw value}``; JSON rows are parsed, T rows are text.

    Lines that are not rows (a captured page's visible text follows its rows) are skipped.
    Tagged non-data rows (imports, hints, errors) are kept as ``("tag", payload)`` tuples.
    """
    rows = Rows()
    rows.n_bytes = len(data)
    pos, n = 0, len(data)
    in_text = False  # past the rows, in a captured page's visible text
    if data.startswith(b"\xef\xbb\xbf"):
        pos = 3
    while pos < n:
        m = _ROW_ID.match(data, pos)
        if m is None:
            in_text = True
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            pos = nl + 1
            continue
        row_id = m.group(1).decode("ascii").lower()
        pos = m.end()
        tag = data[pos] if pos < n else None
        if tag in _LENGTH_PREFIXED:
            comma = data.find(b",", pos + 1, pos + 18)
            hexlen = data[pos + 1 : comma] if comma > 0 else b""
            if comma > 0 and hexlen and all(c in b"0123456789abcdefABCDEF" for c in hexlen):
                length = int(hexlen, 16)
                start = comma + 1
                body = data[start : start + length]
                if len(body) < length:
                    raise FlightError(
                        f"row {row_id} announces {length} bytes but only {len(body)} follow: the text is truncated"
                    )
                if tag == ord("T"):
                    try:
                        rows[row_id] = body.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise FlightError(f"text row {row_id} is not valid UTF-8 at byte {exc.start}") from exc
                else:
                    rows[row_id] = ("binary", body)
                pos = start + length
                continue
        nl = data.find(b"\n", pos)
        end = n if nl < 0 else nl
        payload = data[pos:end]
        pos = end + 1
        if not payload or (in_text and row_id in rows):
            continue  # visible text such as "8:30" must not replace a row
        if payload[0] in _JSON_START:
            try:
                rows[row_id] = orjson.loads(payload)
                if (key := _repeated_key(payload)) is not None:
                    raise FlightError(f"row {row_id} holds the key {key!r} twice: refused, as readers disagree on "
                                      "which one counts (DuckDB's read_json takes the first, Python's parsers the last)")
            except orjson.JSONDecodeError as exc:
                if in_text:  # visible text that happens to start like a row ("10:00 am")
                    continue
                if nl < 0 and "end of data" in str(exc):
                    raise FlightError(f"row {row_id} is truncated: the text ends inside it ({exc})") from exc
                raise FlightError(f"row {row_id} is not valid JSON: {exc}") from exc
        else:
            rows[row_id] = ("tag", payload.decode("utf-8", "replace"))
    return rows


class _Resolver:
    def __init__(self, rows: dict[str, Any]):
        self.rows = rows
        self.done: dict[str, Any] = {}
        self.active: set[str] = set()

    def row(self, row_id: str) -> Any:
        if row_id in self.done:
            return self.done[row_id]
        if row_id not in self.rows:
            raise FlightError(f"reference to row {row_id}, which the text does not contain")
        if row_id in self.active:
            raise FlightError(f"row {row_id} refers to itself through a cycle of references")
        self.active.add(row_id)
        raw = self.rows[row_id]
        value = raw if isinstance(raw, tuple) else self.value(raw)
        self.active.discard(row_id)
        self.done[row_id] = value
        return value

    def string(self, s: str) -> Any:
        if len(s) < 2 or s[0] != "$":
            return s
        c = s[1]
        if c == "$":
            return s[1:]
        if c == "D":
            try:
                dt = datetime.fromisoformat(s[2:].replace("Z", "+00:00"))
                # A date without a zone is UTC (never the machine's zone, as astimezone would read it).
                return dt.astimezone(timezone.utc) if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
            except ValueError as exc:
                raise FlightError(f"date {s[2:]!r} is not an ISO timestamp") from exc
        if s == "$undefined":
            return _UNDEFINED
        if c == "n" and s[2:].lstrip("-").isdigit():
            return _bigint(s[2:])
        if s in ("$I", "$Infinity"):
            return math.inf
        if s == "$-Infinity":
            return -math.inf
        if s in ("$N", "$NaN"):
            return math.nan
        if s == "$-0":
            return -0.0
        if c in "@QW" and _HEX.fullmatch(s[2:]):  # promise, Map, Set: the row's value
            return self.row(s[2:])
        head, _, path = s[1:].partition(":")
        if _HEX.fullmatch(head):
            value = self.row(head)
            for part in path.split(":") if path else ():
                try:
                    value = value[int(part)] if isinstance(value, list) else value[part]
                except (KeyError, IndexError, ValueError, TypeError) as exc:
                    raise FlightError(f"reference {s!r} does not resolve: no {part!r}") from exc
            return value
        return s  # "$", "$L<hex>" lazy components and other markers stay as written

    def value(self, v: Any) -> Any:
        t = type(v)
        if t is str:
            return self.string(v) if v.startswith("$") else v
        if t is list:
            out = []
            for x in v:
                tx = type(x)
                if tx is float or tx is int or x is None or tx is bool:
                    out.append(x)
                    continue
                x = self.value(x)
                out.append(None if x is _UNDEFINED else x)
            return out
        if t is dict:
            d = {}
            for k, x in v.items():
                x = self.value(x)
                if x is not _UNDEFINED:
                    d[k] = x
            return d
        return v


def _check_expansion(value: Any, limit: int) -> None:
    """Raise :class:`ExpansionError` when ``value`` written out in full (each row as often as it
    is referred to) holds more than ``limit`` values and characters.

    The decoder shares one object among all references to a row, so decoding costs no more
    than the text; what reads the value next (the schema check, the records, JSON dumps of
    ``logitContributions``) walks every reference. This counts each distinct object once
    (memoised by identity), so a bomb is measured in a few steps per row, before anything
    expands it.
    """
    sizes: dict[int, int] = {}  # a list's or dict's size, by identity

    def size(v: Any) -> int:
        t = type(v)
        if t is str:
            n = 1 + len(v)
        elif t is not list and t is not dict:
            return 1
        elif (n := sizes.get(id(v), -1)) >= 0:
            return n
        else:
            items = v if t is list else v.values()
            kinds = set(map(type, items))  # token and value lists are read in C, not item by item
            if kinds <= _SCALARS:
                n = 1 + len(v)
            elif kinds <= _SCALARS | {str}:
                n = 1 + len(v) + (sum(map(len, items)) if kinds == {str} else sum(len(x) for x in items if type(x) is str))
            else:
                n = 1 + sum(map(size, items))
            if t is dict:
                n += sum(map(len, v))  # the keys' characters
            sizes[id(v)] = n
        if n > limit:
            raise ExpansionError(f"row references expand the page to more than {limit:,} values and characters")
        return n

    size(value)


def _bigint(digits: str) -> int | float:
    """A ``$n`` BigInt as the same digits written as a JSON number read in the Python road
    (orjson): an int from -2**63 to 2**64 - 1, a float beyond (a 5,000-digit one is inf). An
    int past 64 bits stopped the run where a record was written out as JSON (orjson cannot), and
    Python refuses to convert over 4,300 digits to an int."""
    if len(digits.lstrip("-")) <= 20:
        value = int(digits)
        if -(2**63) <= value < 2**64:
            return value
    return float(digits)


def decode(rows: dict[str, Any], value: Any, *, max_units: int | None = None) -> Any:
    """Resolve every ``$`` encoding and row reference inside ``value``.

    Raises :class:`ExpansionError` when the result, written out in full, would hold more than
    ``max_units`` values and characters (by default :func:`expansion_limit` of ``rows``).
    """
    out = _Resolver(rows).value(value)
    _check_expansion(out, expansion_limit(rows) if max_units is None else max_units)
    return out


def find_key(rows: dict[str, Any], key: str, *, max_units: int | None = None) -> tuple[bool, Any]:
    """Find the first object property named ``key`` in any row, and decode its value.

    Every data row is searched in order, depth first, so the key is found wherever the page
    nests it, not at a fixed position. Returns ``(found, decoded value)``. The value's
    expansion is bounded as :func:`decode` bounds it.
    """
    stack: list[Any] = [v for v in reversed(list(rows.values())) if not isinstance(v, tuple)]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            if key in v:
                val = decode(rows, v[key], max_units=max_units)
                return True, (None if val is _UNDEFINED else val)
            stack.extend(x for x in reversed(list(v.values())) if type(x) in (dict, list))
        elif type(v) is list:
            stack.extend(x for x in reversed(v) if type(x) in (dict, list))
    return False, None


_PUSH = "self.__next_f.push("


def iter_html_chunks(html: str) -> Iterator[list]:
    """Yield the array argument of every ``self.__next_f.push(...)`` call in a page."""
    decoder = json.JSONDecoder()
    idx = 0
    while True:
        i = html.find(_PUSH, idx)
        if i < 0:
            return
        start = i + len(_PUSH)
        try:
            arr, end = decoder.raw_decode(html, start)
        except json.JSONDecodeError as exc:
            line = html.count("\n", 0, i) + 1
            raise FlightError(f"__next_f chunk on line {line} is not a valid array: {exc.msg}") from exc
        if not isinstance(arr, list) or not arr:
            raise FlightError(f"__next_f chunk at offset {i} is not a non-empty array")
        yield arr
        idx = end


def html_to_flight(html: str) -> bytes:
    """Join a saved page's ``__next_f`` chunks, in order, into the flight bytes they carry."""
    out = bytearray()
    for arr in iter_html_chunks(html):
        kind = arr[0]
        if kind == 1 and len(arr) > 1 and isinstance(arr[1], str):
            out += arr[1].encode("utf-8", "surrogatepass")
        elif kind == 3 and len(arr) > 1 and isinstance(arr[1], str):
            try:
                out += base64.b64decode(arr[1], validate=True)
            except ValueError as exc:
                raise FlightError("a base64 __next_f chunk does not decode") from exc
    return bytes(out)
