"""Write one feature page in every shape Neuronpedia produces, for tests.

Written from the format notes (shared/docs/neuronpedia-formats.md), independently of
``pipeline/stages/flight.py``, so that a test which encodes here and decodes there checks the decoder
against a second reading of the format, not against itself.

A page is a plain dict. Two Python values stand for what JSON cannot say: ``datetime`` (the
API sends an ISO string, the flight text ``"$D<iso>"``) and :data:`UNDEFINED` (the API omits the
key, the flight text says ``"$undefined"``).
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import random
from datetime import datetime, timezone
from typing import Any


class _Undefined:
    def __repr__(self) -> str:
        return "UNDEFINED"


UNDEFINED = _Undefined()
#: Strings of this many characters or more go to their own T row.
T_ROW_MIN_CHARS = 1024


def js_iso(dt: datetime) -> str:
    """A datetime as JavaScript's ``Date.toISOString()`` writes it (UTC, milliseconds, ``Z``)."""
    if dt.tzinfo is not None:
        dt = dt.astimezone(timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def parse_js_iso(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


# --- API JSON -------------------------------------------------------------------------


def _api_value(v: Any) -> Any:
    if isinstance(v, datetime):
        return js_iso(v)
    if isinstance(v, dict):
        return {k: _api_value(x) for k, x in v.items() if x is not UNDEFINED}
    if isinstance(v, list):
        return [None if x is UNDEFINED else _api_value(x) for x in v]
    return v


def to_api_json(page: dict) -> bytes:
    """The page as ``GET /api/feature/...`` answers it."""
    return json.dumps(_api_value(page), ensure_ascii=False, allow_nan=False).encode("utf-8")


# --- flight text ------------------------------------------------------------------------


class FlightWriter:
    """Builds flight rows: JSON rows, T rows for long strings, rows referenced by ``"$<hex>"``.

    ``outline`` is the chance that a dict or list is moved into a row of its own and
    referenced, so the decoder must follow references; ``rng`` makes that reproducible.
    """

    def __init__(self, *, first_id: int = 0x20, outline: float = 0.0, rng: random.Random | None = None):
        self.rows: list[bytes] = []
        self.next_id = first_id
        self.outline = outline
        self.rng = rng or random.Random(0)

    def _new_id(self) -> str:
        rid = format(self.next_id, "x")
        self.next_id += 1
        return rid

    def encode(self, v: Any) -> Any:
        """The JSON-able value that stands for ``v`` inside a row (adding rows as needed)."""
        if v is UNDEFINED:
            return "$undefined"
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, datetime):
            return "$D" + js_iso(v)
        if isinstance(v, int):
            return v if -(2**53) < v < 2**53 else f"$n{v}"
        if isinstance(v, float):
            if math.isnan(v):
                return "$NaN"
            if math.isinf(v):
                return "$Infinity" if v > 0 else "$-Infinity"
            if v == 0 and math.copysign(1.0, v) < 0:
                return "$-0"
            return v
        if isinstance(v, str):
            if len(v) >= T_ROW_MIN_CHARS:
                rid = self._new_id()
                raw = v.encode("utf-8")
                # length in UTF-8 bytes, in hex, and no newline after the text
                self.rows.append(f"{rid}:T{len(raw):x},".encode() + raw)
                return f"${rid}"
            return "$" + v if v.startswith("$") else v
        if isinstance(v, dict):
            out = {k: self.encode(x) for k, x in v.items()}
        elif isinstance(v, (list, tuple)):
            out = [self.encode(x) for x in v]
        else:
            raise TypeError(f"cannot encode {type(v).__name__}")
        if self.outline and self.rng.random() < self.outline:
            return f"${self.json_row(out)}"
        return out

    def json_row(self, encoded: Any, rid: str | None = None) -> str:
        """Append an already-encoded value as a JSON row; return its id."""
        rid = rid or self._new_id()
        text = json.dumps(encoded, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        self.rows.append(f"{rid}:{text}\n".encode())
        return rid

    def text(self) -> bytes:
        return b"".join(self.rows)


def to_flight(page: dict, *, outline: float = 0.3, seed: int = 0, trailing_text: bool = True) -> bytes:
    """The page as its web page's flight payload: ``initialNeuron`` deep in a React element tree.

    The page's model, source and source set are moved into rows of their own (referenced by
    ``"$<hex>"``, the sources row before and the model row after the tree), other containers
    are outlined at random, and a captured page's visible text follows the rows.
    """
    w = FlightWriter(first_id=0x10, outline=outline, rng=random.Random(seed))
    w.rows.append(b'1:I["(app-pages-browser)/./components/feature.tsx",["app/page","static/chunks/1.js"],"FeatureDashboard"]\n')
    w.rows.append(b'2:HL["/_next/static/css/app.css","style"]\n')
    page = dict(page)
    model = page.pop("model", UNDEFINED)
    source_set = page.pop("sourceSet", UNDEFINED)
    enc = {}
    for k, v in page.items():
        enc[k] = w.encode(v)
    if source_set is not UNDEFINED:
        enc["sourceSet"] = "$" + w.json_row(w.encode(source_set))
    tree = [
        "$", "div", None,
        {"className": "h-full w-full", "children": [
            ["$", "$L1", None, {"title": "$$ not a reference", "when": "$undefined"}],
            ["$", "section", "main", {"children": ["$", "$L1", None, {
                "initialNeuron": enc,
                "dates": ["$D2025-01-01T00:00:00.000Z"],
            }]}],
        ]},
    ]
    if model is not UNDEFINED:
        model_id = w._new_id()
        enc["model"] = f"${model_id}"
    w.json_row(tree, rid="8")
    if model is not UNDEFINED:
        w.json_row(w.encode(model), rid=model_id)
    out = w.text()
    if trailing_text:
        out += "\nGPT-OSS-20B · 11-RESID-POST-AA\n\nNo Comments\n\nNo Known Activations\n".encode()
    return out


# --- saved HTML -------------------------------------------------------------------------

_HTML_ESCAPES = {"&": "\\u0026", "<": "\\u003c", ">": "\\u003e", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _js_string(s: str) -> str:
    text = json.dumps(s, ensure_ascii=False)
    for ch, esc in _HTML_ESCAPES.items():
        text = text.replace(ch, esc)
    return text


def to_html(flight_text: bytes, *, seed: int = 0, n_chunks: int = 7) -> bytes:
    """A saved page: the flight text cut into ``__next_f`` pushes at arbitrary points.

    Cuts fall anywhere (inside rows, inside T rows) except inside one character; one stretch
    of bytes travels as a base64 ``[3, ...]`` chunk.
    """
    rng = random.Random(seed)
    text = flight_text.decode("utf-8")
    cuts = sorted(rng.sample(range(1, len(text)), min(n_chunks - 1, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    b64_at = rng.randrange(len(pieces))
    scripts = ["<script>self.__next_f.push([0])</script>"]
    for i, piece in enumerate(pieces):
        if i == b64_at:
            arg = '[3,"' + base64.b64encode(piece.encode("utf-8")).decode() + '"]'
        else:
            arg = "[1," + _js_string(piece) + "]"
        scripts.append(f"<script>self.__next_f.push({arg})</script>")
    html = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Neuronpedia</title>'
        '<script src="/_next/static/chunks/webpack.js" async=""></script></head>'
        "<body><div id=\"main\">Feature dashboard &amp; more</div>"
        + "".join(scripts)
        + "</body></html>\n"
    )
    return html.encode("utf-8")


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def all_formats(page: dict, *, seed: int = 0) -> dict[str, bytes]:
    """The page as API JSON, flight text, saved HTML, and gzip of each."""
    flight_text = to_flight(page, seed=seed)
    shapes = {"api_json": to_api_json(page), "flight": flight_text, "html": to_html(flight_text, seed=seed)}
    shapes.update({f"gzip+{k}": gz(v) for k, v in list(shapes.items())})
    return shapes
