"""Gzip, read within limits: a page's gzip bytes undone in memory (refusing a gzip bomb, a
truncated or corrupt stream), an export file measured whole as it streams (its size, its lines,
a whole page in a file of export rows refused), and the first lines of a gzip file.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

try:  # ISA-L's gzip: the same format checks, twice as fast (a many-GB export batch is read whole once)
    from isal import igzip as _igzip
except ImportError:  # pragma: no cover - a dependency; the standard library still works
    _igzip = None

from .rejected import Rejected

__all__ = ["PAGE_KEY_BYTES", "gunzip_limited", "gunzip_measure", "open_gzip", "first_line", "first_lines"]

_GZIP_MAGIC = b"\x1f\x8b"


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
