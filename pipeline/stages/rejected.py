"""Refusals: :class:`Rejected` (an input that is no usable feature page, with why) and the words
for text that is not UTF-8 or not JSON, which every reading road of the parse stage uses.
"""

from __future__ import annotations

__all__ = ["Rejected", "NotAnObject"]


class Rejected(ValueError):
    "The input is not a usable feature page; the message says why, for a person to act on."


class NotAnObject(Rejected):
    """A line of an export file that is not a JSON object (to orjson, the Python road's parser):
    ``problem`` says what it is, as the plain-lines road says it ("is not valid JSON (...)")."""

    def __init__(self, n: int, problem: str) -> None:
        super().__init__(f"line {n} {problem}")
        self.problem = problem



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
