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

__all__ = ["FlightError", "parse_rows", "decode", "find_key", "html_to_flight", "looks_like_flight"]


class FlightError(ValueError):
    "The flight text is malformed; the message says where."


_ROW_ID = re.compile(rb"([0-9a-fA-F]{1,8}):")
_HEX = re.compile(r"[0-9a-f]+")
# Row tags followed by "<hex length>," and that many bytes (text and binary typed arrays).
_LENGTH_PREFIXED = frozenset(b"TABOoUSsLlGgMmV")
_JSON_START = frozenset(b'[{"-0123456789tfn')
_UNDEFINED = object()


def looks_like_flight(data: bytes) -> bool:
    """True when the bytes start with a flight row (``<hex id>:`` then a payload)."""
    m = _ROW_ID.match(data.lstrip(b"\xef\xbb\xbf"))
    return bool(m) and len(data) > m.end()


def parse_rows(data: bytes) -> dict[str, Any]:
    """Split flight bytes into ``{row id: raw value}``; JSON rows are parsed, T rows are text.

    Lines that are not rows (a captured page's visible text follows its rows) are skipped.
    Tagged non-data rows (imports, hints, errors) are kept as ``("tag", payload)`` tuples.
    """
    rows: dict[str, Any] = {}
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
            return int(s[2:])
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


def decode(rows: dict[str, Any], value: Any) -> Any:
    """Resolve every ``$`` encoding and row reference inside ``value``."""
    return _Resolver(rows).value(value)


def find_key(rows: dict[str, Any], key: str) -> tuple[bool, Any]:
    """Find the first object property named ``key`` in any row, and decode its value.

    Every data row is searched in order, depth first, so the key is found wherever the page
    nests it, not at a fixed position. Returns ``(found, decoded value)``.
    """
    stack: list[Any] = [v for v in reversed(list(rows.values())) if not isinstance(v, tuple)]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            if key in v:
                val = _Resolver(rows).value(v[key])
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
