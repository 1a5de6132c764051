"""The streaming check of a bulk-export file's lines (``LineCheck``): fed the decompressed
bytes while the file is measured, it finds the lines DuckDB's typed read would take otherwise
than the Python road (they take the Python road, one line at a time) and the fields the typed
read has no column for. The export road that reads the file is ``export_road.py``.
"""

from __future__ import annotations

import simdjson

from .columns import _EXPORT_COLUMNS, _EXPORT_TYPED, _exact_fields
from .parse import repeated_key
from .records import PAGE_RELATIONS

_MAX_OBJECT = 1 << 25  # read_json's maximum_object_size, and the longest line the scan holds
#: An activation file's columns are read from its first lines (the other files': from all)
_ACTIVATION_KEY_LINES = 10_000


class LineCheck:
    """Finds, in a stream of an export file's bytes, the lines DuckDB's typed read would take
    otherwise than the Python road: objects that hold a key twice, or hold an object that does
    (read_json keeps the first, or both in a JSON column's text, Python the last; a page with
    one is refused) or whose typed fields do not hold what they say
    (``_exact_fields``). Their positions among the file's non-blank lines (from 1, as DuckDB's
    rows) are in ``inexact``: those lines take the Python road, one line at a time.

    Fed the decompressed bytes in chunks, while the file is measured (``parse.gunzip_measure``),
    so it costs a simdjson parse a line (~1 CPU-s a GB), not a second decompression. A line that
    is not JSON, or not an object, is left to the reading that follows (a bad line), as is one
    longer than ``_MAX_OBJECT``.

    A line holding a field the read has no column for takes the Python road too, which keeps it
    in ``extra``: in an activation file, one its first ``_ACTIVATION_KEY_LINES`` lines lack
    (``_unknown_fields`` reads the columns from them), and any of ``avoid`` (``read_exports``:
    another field's spelling in other case, "foo" beside "Foo").

    ``fields`` then holds the file's fields the typed read does not know (of an activation
    file, those of its first lines), as ``_file_fields`` would read them with DuckDB: handed to
    ``read_exports``, they spare it that second pass over the file.
    """

    def __init__(self, table: str, avoid: frozenset[str] = frozenset()) -> None:
        self.typed = _EXPORT_TYPED[table]
        self._known = {k.lower(): k for k in _EXPORT_COLUMNS[table]}
        self._avoid = avoid
        self._exact_known = frozenset(_EXPORT_COLUMNS[table]) | PAGE_RELATIONS
        self._window = _ACTIVATION_KEY_LINES if table == "activations" else None
        self._parser = simdjson.Parser()
        self._shapes: dict[tuple[str, ...], bool] = {}
        self.reset()

    def reset(self) -> None:
        self.inexact: list[int] = []
        self.page_line: int | None = None  # the first line holding a page's own key (model, activations...)
        self._pos = 0
        self._pending = b""
        self._too_long = False  # inside a line past _MAX_OBJECT: counted once, not parsed
        self._columns = set(self._known.values())  # and the fields of the window's lines (of every line)

    def feed(self, chunk: bytes) -> None:
        lines = chunk.split(b"\n")
        if self._pending:  # (joined to the first piece only: not a copy of the whole chunk)
            lines[0] = self._pending + lines[0]
        self._pending = lines.pop()
        for line in lines:
            if self._too_long:
                self._too_long = False  # its end: it was counted when it began
                continue
            self._line(line)
        if len(self._pending) >= _MAX_OBJECT:
            if not self._too_long:
                self._pos += 1
                self._too_long = True
            self._pending = b""

    def finish(self) -> list[int]:
        if self._pending and not self._too_long:
            self._line(self._pending)
        self._pending = b""
        return self.inexact

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return  # read_json skips blank lines: they have no position
        self._pos += 1
        try:
            doc = self._parser.parse(line)
        except (ValueError, RuntimeError):
            # Not JSON to simdjson (NaN, a trailing comma, a number past 64 bits, nesting past
            # its depth, bytes that are not UTF-8): DuckDB's reader may take what orjson does
            # not, so the Python road judges it, as it judges the line in a plain .jsonl file
            # (a line DuckDB cannot read either is set aside as a bad line first).
            self.inexact.append(self._pos)
            return
        try:
            if type(doc) is simdjson.Object:
                keys = list(doc.keys())
                if self.page_line is None and not PAGE_RELATIONS.isdisjoint(keys):
                    self.page_line = self._pos  # a whole page among export rows: the file is refused
                if (not self._read_as_columns(keys) or not self._plain_keys(keys)
                        or not _exact_fields(doc, self.typed, keys)
                        # an object in it (a memchr finds none in most lines) holding a key twice
                        or (line.find(b"{", line.find(b"{") + 1) >= 0 and repeated_key(doc, line) is not None)):
                    self.inexact.append(self._pos)
        finally:
            del doc  # the parser is reused only once nothing refers to its last document

    def _read_as_columns(self, keys: list[str]) -> bool:
        """Whether DuckDB's read has a column for each of a line's fields (the class's doc)."""
        if self._avoid and not self._avoid.isdisjoint(keys):
            return False
        if self._window is None or self._pos <= self._window:
            self._columns.update(keys)
            return True
        return self._columns.issuperset(keys)

    @property
    def fields(self) -> frozenset[str]:
        """The fields seen that the typed read does not know, as written (the class's doc)."""
        return frozenset(self._columns - self._exact_known)

    def _plain_keys(self, keys: list[str]) -> bool:
        """No key twice, and every key spelled as known (``_spelled_as_known``); judged once
        for each list of keys (the lines of a file mostly share one)."""
        shape = tuple(keys)
        plain = self._shapes.get(shape)
        if plain is None:
            plain = len(keys) == len(set(keys)) and self._spelled_as_known(keys)
            if len(self._shapes) < 1024:
                self._shapes[shape] = plain
        return plain

    def _spelled_as_known(self, keys: list[str]) -> bool:
        """No key is a known field spelled in other case ("MaxValue"), nor two keys one name in
        two cases: DuckDB's columns are one name in any case (the read cannot hold both)."""
        lowered = {k.lower() for k in keys}
        if len(lowered) != len(keys):
            return False
        known = self._known
        return all(known.get(k.lower(), k) == k for k in keys)
