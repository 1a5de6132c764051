"""Charts drawn in a child process, so that the chart renderer can never take a load down.

vl-convert draws Vega-Lite with a JavaScript engine (V8) inside the process that imports it.
On its first drawing V8 reserves a large address-space cage: under an address-space limit
(``ulimit -v``, as HPC login nodes and batch schedulers set) it aborts the whole process with
SIGTRAP ("Fatal process out of memory: Oilpan: CagedHeap reservation"), a panic in it aborts
the process too, and while it draws it holds the GIL. So the report's charts are drawn by one
child Python process (``_draw_child.py``, which imports nothing of featurehouse) that lives as
long as this process: specs go down its stdin, SVG comes back on its stdout. When the child
cannot start or dies, :class:`DrawerUnavailable` says why in one line; the report is then
written without its charts and says so, and nothing else in the run notices.

Written by hand rather than with ``concurrent.futures.ProcessPoolExecutor``: its spawned worker
imports the parent's ``__main__`` again (the CLI, an Airflow task runner: seconds of imports, and
a module that is not safe to import twice), and a forked one would copy DuckDB's threads.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("featurehouse")

__all__ = ["DrawerUnavailable", "draw_svg", "start", "drew_any", "renderer_version"]

_CHILD = Path(__file__).with_name("_draw_child.py")
#: Seconds one chart may take before the drawer is taken for hung (a chart takes ~0.01-0.4 s).
CHART_TIMEOUT = float(os.environ.get("FEATUREHOUSE_CHART_TIMEOUT", "120"))


class DrawerUnavailable(RuntimeError):
    """The chart renderer could not start, or stopped: the message says why, in one line."""


def renderer_version() -> str:
    """vl-convert's version, without importing it (it is the child's to import)."""
    from importlib import metadata

    try:
        return metadata.version("vl-convert-python")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Drawer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.err: Any = None
        self.broken: str | None = None  # why it cannot draw: said once, not tried again
        self.drawn = 0
        self.unread = 0  # answers to warm-up specs (``start``) not read yet

    def _spawn(self) -> subprocess.Popen:
        self.err = tempfile.TemporaryFile()  # V8's last words (its fatal error) are read from here
        try:
            return subprocess.Popen([sys.executable, "-I", str(_CHILD)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=self.err, close_fds=True,
                                    start_new_session=True)  # a ^C to the terminal is the parent's to handle
        except OSError as exc:
            raise DrawerUnavailable(f"the chart renderer could not start: {exc.strerror or exc}") from None

    def _why_stopped(self, proc: subprocess.Popen) -> str:
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        said = ""
        if self.err is not None:
            self.err.seek(0)
            lines = [ln.strip() for ln in self.err.read()[-4096:].decode("utf-8", "replace").splitlines() if ln.strip()]
            said = next((ln for ln in lines if "Fatal" in ln or "Error" in ln), lines[-1] if lines else "")
        try:
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        except ValueError:  # a real-time signal has no name
            how = f"signal {-rc}"
        hint = ""
        if "CagedHeap" in said or "out of memory" in said.lower() or rc == -signal.SIGTRAP:
            hint = " (its JavaScript engine needs more address space than the limit allows: `ulimit -v`)"
        return f"the chart renderer stopped ({how}{': ' + said[:200] if said else ''}){hint}"

    def _stop(self) -> None:
        proc, self.proc, self.unread = self.proc, None, 0
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.err is not None:
            self.err.close()
            self.err = None

    def warm(self) -> None:
        """Start the child and hand it the smallest chart, without waiting for its answer (read
        before the first real chart's): its engine starts while this process goes on."""
        with self.lock:
            if self.broken is not None:
                raise DrawerUnavailable(self.broken)
            if self.proc is not None:
                return
            self.proc = self._spawn()
            try:
                self._send(self.proc, TINY_SPEC)
            except DrawerUnavailable as exc:
                self._stop()
                self.broken = str(exc)
                raise
            self.unread += 1

    def draw(self, spec: dict) -> str:
        with self.lock:
            if self.broken is not None:
                raise DrawerUnavailable(self.broken)
            for attempt in (1, 2):  # a drawer that had drawn and then died is started once more
                if self.proc is None:
                    self.proc = self._spawn()
                try:
                    while self.unread:  # the warm-up's answer (its chart is not wanted)
                        code, _ = self._answer(self.proc)
                        self.unread -= 1
                        self.drawn += code == b"k"  # it drew: one that dies after is started again
                    svg = self._ask(self.proc, spec)
                except DrawerUnavailable as exc:
                    self._stop()
                    if attempt == 2 or not self.drawn:
                        self.broken = str(exc)
                        raise
                    continue
                self.drawn += 1
                return svg
        raise AssertionError("unreachable")

    def _ask(self, proc: subprocess.Popen, spec: dict) -> str:
        self._send(proc, spec)
        code, payload = self._answer(proc)
        if code != b"k":
            raise ChartFailed(payload)
        return payload

    def _send(self, proc: subprocess.Popen, spec: dict) -> None:
        body = json.dumps(spec, default=str).encode()
        try:
            proc.stdin.write(struct.pack(">I", len(body)) + body)
            proc.stdin.flush()
        except (BrokenPipeError, ConnectionError, OSError):
            raise DrawerUnavailable(self._why_stopped(proc)) from None

    def _answer(self, proc: subprocess.Popen) -> tuple[bytes, str]:
        """The next answer: ``k`` and the SVG, or ``e`` and why the chart was refused."""
        try:
            head = self._read(proc, 5)
            code, n = head[:1], struct.unpack(">I", head[1:])[0]
            return code, self._read(proc, n).decode("utf-8", "replace")
        except (ConnectionError, EOFError, OSError):
            raise DrawerUnavailable(self._why_stopped(proc)) from None

    def _read(self, proc: subprocess.Popen, n: int) -> bytes:
        out = bytearray()
        deadline = time.monotonic() + CHART_TIMEOUT
        fd = proc.stdout.fileno()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                proc.kill()
                raise DrawerUnavailable(f"the chart renderer did not answer in {CHART_TIMEOUT:.0f} s")
            chunk = os.read(fd, min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError
            out += chunk
        return bytes(out)


class ChartFailed(ValueError):
    """The renderer refused one chart (its spec); it goes on drawing the others."""


_drawer = _Drawer()
atexit.register(_drawer._stop)


def draw_svg(spec: dict) -> str:
    """``spec`` (Vega-Lite, as a dict) drawn as SVG by the child. Raises
    :class:`DrawerUnavailable` when the renderer cannot draw at all, :class:`ChartFailed` when it
    refused this one chart."""
    return _drawer.draw(spec)


#: The smallest chart: drawing it starts the renderer's engine (see :func:`start`).
TINY_SPEC = {"data": {"values": [{"x": 1}]}, "mark": "point", "encoding": {"x": {"field": "x", "type": "quantitative"}}}


def start() -> None:
    """Start the renderer and its engine (~0.4 s of one core in the child) ahead of the first
    real chart, without waiting for it: the first chart waits for what is left of it. Raises
    :class:`DrawerUnavailable` when the child cannot start (one that stops while its engine
    starts is said by the first chart)."""
    _drawer.warm()


def drew_any() -> bool:
    """Whether this process had a chart drawn (a re-run that changed nothing draws none)."""
    return _drawer.drawn > 0 or _drawer.proc is not None
