"""The chart renderer's process (see ``draw.py``): reads Vega-Lite specs from stdin, writes SVG to
stdout, until stdin closes. Each message is a 4-byte big-endian length and that many bytes; each
answer is ``k`` (drawn) or ``e`` (refused: the error's text), a length, and the bytes.

Run as a script (``python -I _draw_child.py``): it imports nothing of featurehouse.
"""

import json
import resource
import signal
import struct
import sys


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the drawing stops
    # no core file when the engine aborts (under `ulimit -c unlimited` and an address-space
    # limit: 25 MB in the working folder at every report)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    import vl_convert as vlc

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        (n,) = struct.unpack(">I", head)
        spec = json.loads(inp.read(n))
        try:
            code, body = b"k", vlc.vegalite_to_svg(spec).encode("utf-8")
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException (pyo3's PanicException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            code, body = b"e", f"{type(exc).__name__}: {exc}".splitlines()[0][:500].encode("utf-8")
        out.write(code + struct.pack(">I", len(body)) + body)
        out.flush()


if __name__ == "__main__":
    main()
