"""Bulk-export JSON lines, read on the Python road: a file of export rows (a line that is no
record set aside, too many refusing the file) or of whole pages one a line, and one export line
read alone (``parse_export_line``), each row made its typed record.
"""

from __future__ import annotations

from typing import Any

import orjson

from .coerce import (
    _DIGITS,
    _INT64,
    _activation,
    _explanation,
    _feature,
    _model,
    _source,
    _source_set,
)
from .page_check import _add_page, _check_keys_once, json_view
from .records import InputFormat, ParsedInput
from .rejected import NotAnObject, Rejected, _json_error

__all__ = ["parse_export_line", "MAX_BAD_LINES"]



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
    # as coerce._int: a number, or ASCII digits ("2_004", " 12" and "1904.0" are no integers)
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
