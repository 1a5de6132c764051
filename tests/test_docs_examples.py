"""Every example in README.md and docs/*.md runs as pasted.

Each fenced block is an example, one test id per example (``page:line``), run for real:

- a shell block: its command lines in order, each in ``bash -c`` (the virtualenv on ``PATH``, as
  after ``source .venv/bin/activate``), in a folder of the block's own holding ``warehouse/``:
  the warehouse ``make run`` leaves (the bundled samples, then ``featurehouse index``); a
  ``featurehouse migrate`` in a folder holding a 0.1 warehouse instead. Each exits 0, or the
  code the page says (:data:`EXIT_CODES`); a JSON document its comment shows is what it prints.
- an ``sql`` block: through ``featurehouse sql`` against that warehouse, or, when it attaches one
  itself, in a plain DuckDB client (offline: the querying page's ``SET extension_directory``
  first), then a count through what it attached.
- a ``python`` block: with the virtualenv's Python; a page's blocks run in order in one
  interpreter, as pasted into one session.
- a ``toml`` block: loaded as ``featurehouse.toml`` (a section: added to the page's whole file).
- a block that shows what a command prints or a folder holds (:data:`OUTPUTS`, by name): what
  the program prints and the folder holds.

A command written inline in a page's prose (`` `featurehouse show MODEL/SOURCE/INDEX` ``) names
a real command and real options (click parses it); one with arguments and no stand-in left, of a
command that reads or writes only the warehouse (:data:`INLINE_RUN`), runs as a shell example
of its page, in the world its sentence says (:data:`INLINE_WORLDS`).

Only what a reader puts in place of a stand-in is replaced (:data:`STAND_INS`): the feature
API and the export bucket are a local fake Neuronpedia (``NEURONPEDIA_BASE_URL``,
``NEURONPEDIA_EXPORTS_URL``); a published folder is served on loopback. A page whose examples
name features the samples do not hold runs on the samples plus a generated source
(:data:`RICH_PAGES`). What cannot run in a unit test is listed, with why, in :data:`SKIPPED`.
An example that fails as pasted is a wrong page: fix the page.

The examples run in the background as soon as the module starts, two at a time when pytest
runs alone (one under pytest-xdist, whose other workers hold the cores); each test waits for
its own.
"""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
FEATUREHOUSE = str(VENV_BIN / "featurehouse")

#: The samples' run, named as docs/report.md's `frame_for(..., run_id=...)` names it (`make run`
#: names it by the clock; a reader puts their own there).
SAMPLES_RUN = "run-20261205T170404Z-a4a15a"

#: Shell commands and Python lines that do not run here, and why. Each matches a line of some
#: page (a test checks), so the list cannot outlive what it excuses.
SKIPPED = {
    r"^make\b": "a Makefile target: installs the virtualenv, starts Docker, or runs the whole suite, "
                "lint or benchmark (tests/test_compose.py and the suite itself cover them)",
    r"^docker compose\b": "needs the Docker deployment running (make up)",
    r"^(airflow|bash deploy/airflow-init\.sh)\b": "needs Airflow's metadata database "
                                                  "(tests/test_airflow_*.py run Airflow for real)",
    r"^\.venv/bin/python bench/run_bench\.py": "benchmarks another checkout at ../old-checkout for minutes",
    r"--range 0:5000\b": "5,000 requests: 15 minutes at the default budget of 20,000 an hour, and over "
                         "two minutes against the local fake with the budget lifted",
    r"^rsync\b": "rsync is not installed on this machine",
    r"\bdatasets\b": "Hugging Face's datasets is not installed in the virtualenv (pip install datasets); "
                     "pandas reads the same files",
}
#: Skipped only where the tool is missing.
SKIPPED_WITHOUT = {r"^rsync\b": "rsync"}

#: What a reader puts in place of each stand-in, here: (the attribute of :class:`Runner` that
#: holds it, why). Each is used by some example (a test checks).
STAND_INS = {
    "~/captured-pages/": ("captured_pages", "the reader's own pages: two generated pages"),
    "https://HOST/PATH": ("served_url", "where the reader serves the publication: a loopback server"),
    "https://data.example.org/sae": ("served_url", "likewise"),
    "/path/to/public/": ("served_folder", "the folder published into"),
    "~/.cache/featurehouse/duckdb-extensions": (
        "extension_dir", "where featurehouse installed the extensions ($FEATUREHOUSE_CACHE_DIR moves it)"),
    "RUN_ID": ("run_id", "a run of the warehouse: the samples'"),
    "DIR": ("out_dir", "a folder of the reader's choosing"),
}

#: Pages whose examples name features the samples do not hold (a feature of
#: gemma-3-12b-it/24-gemmascope-2-res-262k, explanations about jokes and Paris): they run on the
#: samples plus a generated source of that model (bench.find_source).
RICH_PAGES = {"docs/finding.md"}

#: Exit codes other than 0 that a page gives a command, and where it says so.
EXIT_CODES = {
    "featurehouse ingest inbox/ --strict": (4, "docs/cli.md: --strict and a FAIL verdict exit 4, and the "
                                               "comment's verdict is FAIL"),
}

#: Blocks that show what a command prints or what a folder holds, by their page and first line:
#: how each is checked, or why it is not.
OUTPUTS = {
    ("README.md", "model_id     source_id"): ("prints", "featurehouse by-token cpu --strip --ignore-case"),
    ("README.md", "warehouse/"): ("holds", "samples"),
    ("docs/lakehouse.md", "warehouse/"): ("holds", "samples"),
    ("docs/publishing.md", "public/"): ("holds", "served"),
    ("docs/bad-input.md", "Error: the landing area"): (
        "not run", "a full disk's message (tests/test_disk_full.py fills one)"),
    ("docs/bad-input.md", "inputs   received 30"): (
        "not run", "the summary of 30 pages read again: its shape is any ingest's summary"),
}

SHELL_LANGS = ("", "sh", "bash", "shell", "console")

#: Commands whose inline examples run (with arguments and no stand-in left): they read the
#: warehouse, or write only it and its own folders (fetch, ingest, serve and migrate need more
#: than a sentence gives; their blocks run).
INLINE_RUN = ("by-token", "show", "similar", "search", "history", "changes", "index", "maintain", "publish",
              "shell", "status", "sql", "report", "config", "materialise")
#: Inline commands whose sentence runs them after something the samples do not hold: the world.
INLINE_WORLDS = {
    ("README.md", "featurehouse search 'comedian"): "rich",  # after the sentence's bench.find_source + ingest
}
#: Words in capitals that stand for what a reader gives (an inline command holding one is parsed,
#: not run), beside :data:`STAND_INS`.
PLACEHOLDER = re.compile(r"(?<![\w/$-])[A-Z][A-Z_]+(?:/[A-Z_]+)*(?![\w])|\.\.\.|s3://")


# --- the examples --------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    page: str
    """The page, relative to the repository: ``docs/fetching.md``."""
    line: int
    """The line the example starts on (a shell command's own line)."""
    kind: str
    """``shell``, ``sql``, ``python``, ``toml`` or ``output``."""
    code: str
    block: int
    """The line of the block's opening fence."""
    comment: str = ""
    """A shell command's comment, with the comment-only lines that continue it."""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}" + (f":{-self.block % 1000}" if self.inline else "")

    @property
    def inline(self) -> bool:
        """A command in a page's prose (its block: minus line × 1000 + its place on the line)."""
        return self.block < 0

    @property
    def world(self) -> str:
        if self.kind == "shell" and "featurehouse migrate " in self.code:
            return "legacy"
        if self.inline:
            return next((w for (page, head), w in INLINE_WORLDS.items()
                         if page == self.page and self.code.startswith(head)), "reader")
        return "rich" if self.page in RICH_PAGES else "reader"

    @property
    def skipped(self) -> str | None:
        """Why a shell command does not run here (a Python line :data:`SKIPPED` names is left
        out of its block instead)."""
        if self.kind != "shell":
            return None
        for pattern, why in SKIPPED.items():
            if re.search(pattern, self.code) and not (
                    pattern in SKIPPED_WITHOUT and shutil.which(SKIPPED_WITHOUT[pattern])):
                return why
        return None


def _blocks(page: Path) -> list[tuple[int, str, list[str]]]:
    """``(fence line, language, lines)`` of each fenced block."""
    out, lines, start, lang = [], page.read_text(encoding="utf-8").splitlines(), None, ""
    for n, line in enumerate(lines, 1):
        m = re.match(r"^\s*(```|~~~)\s*([\w+-]*)", line)
        if not m:
            continue
        if start is None:
            start, lang = n, m.group(2)
        else:
            out.append((start, lang, lines[start:n - 1]))
            start = None
    assert start is None, f"{page}: a block opened on line {start} is not closed"
    return out


def examples() -> list[Example]:
    out = []
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        for start, lang, lines in _blocks(page):
            first = lines[0].strip() if lines else ""
            if any(rel == p and first.startswith(f) for p, f in OUTPUTS):
                out.append(Example(rel, start + 1, "output", "\n".join(lines), start))
            elif lang in ("sql", "python", "toml"):
                out.append(Example(rel, start + 1, lang, "\n".join(lines) + "\n", start))
            elif lang in SHELL_LANGS:
                for i, line in enumerate(lines):
                    text = line.strip()
                    if text.startswith("#") and out and (out[-1].page, out[-1].block) == (rel, start):
                        out[-1] = replace(out[-1], comment=f"{out[-1].comment} {text.lstrip('#').strip()}")
                    elif text and not text.startswith("#"):
                        comment = line.split(" # ", 1)[1].strip() if " # " in line else ""
                        out.append(Example(rel, start + 1 + i, "shell", text, start, comment))
            else:
                raise AssertionError(f"{rel}:{start}: a ```{lang} block: say how to run it in {__name__}")
        out += _inline(page, rel)
    return out


def _word(stand_in: str) -> str:
    """The stand-in as a pattern, not matching inside a longer word (`DIR` in `CACHE_DIR`)."""
    head = r"(?<![\w$])" if re.match(r"\w", stand_in) else ""
    tail = r"(?!\w)" if re.search(r"\w$", stand_in) else ""
    return head + re.escape(stand_in) + tail


def _inline(page: Path, rel: str) -> list[Example]:
    """The page's inline commands (`` `featurehouse ...` `` outside its blocks): ``shell`` when
    they run (:data:`INLINE_RUN`), ``inline`` when they are only parsed."""
    inside = {n for start, _, lines in _blocks(page) for n in range(start, start + len(lines) + 2)}
    out = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if n in inside:
            continue
        for k, m in enumerate(re.finditer(r"`(featurehouse(?: [^`]*)?)`", line), 1):
            code = m.group(1).replace("\\|", "|")  # a table cell's escaped bar
            words = code.split()
            held = re.sub("|".join(_word(w) for w in STAND_INS), "", code)
            runs = (len(words) > 2 and words[1] in INLINE_RUN and not PLACEHOLDER.search(held)
                    and _parse(code, complete=True) is None)
            out.append(Example(rel, n, "shell" if runs else "inline", code, -(n * 1000 + k)))
    return out


def _parse(code: str, complete: bool = False) -> str | None:
    """Why ``code`` (``featurehouse ...``) is not a command featurehouse has: a command, or an
    option, that is not there; with ``complete``, a missing argument too. None when it parses."""
    import click

    from pipeline.cli import cli

    try:
        args = shlex.split(code)[1:]
    except ValueError as exc:
        return f"not a shell command: {exc}"
    cmd, options, path = cli, set(), ["featurehouse"]
    while True:  # down the groups to the command, each level's options allowed before the next word
        options |= {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
        while args and args[0].startswith("-"):
            word = args.pop(0).split("=", 1)[0]
            if word not in options:
                return f"{' '.join(path)} has no option {word}"
            param = next((p for p in cmd.params if word in p.opts), None)
            if param is not None and not getattr(param, "is_flag", False) and not param.count and "=" not in word and args:
                args.pop(0)  # its value
        if not isinstance(cmd, click.Group) or not args:
            break
        if re.fullmatch(r"[A-Z][A-Z_]+", args[0]):  # `featurehouse COMMAND --help`: stands for any
            return None
        sub = cmd.get_command(click.Context(cmd), args[0])
        if sub is None:
            return f"{' '.join(path)} has no command {args[0]!r}"
        path.append(args.pop(0))
        cmd = sub
    if not complete:
        return None
    try:
        with cmd.make_context(path[-1], list(args)) as _:  # the arguments, as the command would take them
            pass
    except (click.UsageError, click.exceptions.Exit) as exc:
        return str(exc) or "exits early"
    return None


EXAMPLES = examples()


def _of(kind: str) -> list:
    return [pytest.param(e, id=e.id) for e in EXAMPLES if e.kind == kind]


# --- the worlds the examples run in --------------------------------------------------------


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def why(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout\n{self.stdout[-3000:]}\n" \
               f"--- stderr\n{self.stderr[-3000:]}"


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> Outcome:
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=timeout)
    return Outcome(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


@dataclass
class Runner:
    """The worlds the examples run in, made once and copied for each, and the examples' runs."""

    root: Path
    fake_url: str
    fake_exports_url: str
    workers: int
    _locks: dict = field(default_factory=dict)
    _made: dict = field(default_factory=dict)
    _jobs: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _n: int = 0
    _server: http.server.HTTPServer | None = None

    def __post_init__(self) -> None:
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="docs-example")

    # what stands in for the stand-ins -------------------------------------------------------

    captured_pages = "captured-pages/"
    run_id = SAMPLES_RUN
    out_dir = "report-copy"

    @property
    def served_url(self) -> str:
        return self._once("served", self._serve)[0]

    @property
    def served_folder(self) -> str:
        return f"{self._once('served', self._serve)[1]}/"

    @property
    def extension_dir(self) -> str:
        """Where featurehouse installed the extensions, after the `featurehouse shell --print`
        docs/querying.md says puts all of them there (httpfs too: a page's client attaches a
        publication over HTTP, and nothing else here may have needed httpfs yet)."""
        return self._once("extensions", self._extensions)

    def _extensions(self) -> str:
        from pipeline.lake.extensions import extension_directory

        got = _run([FEATUREHOUSE, "shell", "--print", "--warehouse", str(self.samples())], self.root, self.env())
        assert got.returncode == 0, got.why()
        folder = extension_directory()
        assert folder is not None and (folder / "v{}".format(__import__("duckdb").__version__)).is_dir(), \
            "featurehouse has no extension folder here"
        return str(folder)

    def substitute(self, code: str) -> str:
        for stand_in, (attr, _) in STAND_INS.items():
            code = re.sub(_word(stand_in), lambda _m, a=attr: getattr(self, a), code)
        return code

    def env(self) -> dict[str, str]:
        """A reader's terminal: the virtualenv on PATH, no setting of ours but where the DuckDB
        extensions are, and Neuronpedia the local fake."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FEATUREHOUSE_", "NEURONPEDIA_")) or k == "FEATUREHOUSE_CACHE_DIR"}
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
        env["NEURONPEDIA_BASE_URL"], env["NEURONPEDIA_EXPORTS_URL"] = self.fake_url, self.fake_exports_url
        return env

    # the worlds -------------------------------------------------------------------------------

    def _once(self, name: str, make):
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self._made:
                self._made[name] = make()
            return self._made[name]

    def samples(self) -> Path:
        """The warehouse `make run` leaves: the samples ingested, the find index built, the
        run's report written again with its Data Docs."""
        def make() -> Path:
            wh = self.root / "samples" / "warehouse"
            for args in (["ingest", str(ROOT / "samples"), "--run-id", SAMPLES_RUN, "--no-progress"], ["index"],
                         ["report"]):
                r = _run([FEATUREHOUSE, *args, "--warehouse", str(wh)], self.root, self.env())
                assert r.returncode == 0, r.why()
            return wh
        return self._once("samples", make)

    def rich(self) -> Path:
        """The samples plus a source of gemma-3-12b-it/24-gemmascope-2-res-262k with embeddings,
        topics (jokes, Paris, ...) and feature 12345, the one docs/finding.md names."""
        def make() -> Path:
            from bench.find_source import write_source
            from pipeline.config import Settings
            from pipeline.outputs import find
            from tests.conftest import run_ingest

            wh = self.root / "rich" / "warehouse"
            shutil.copytree(self.samples(), wh, symlinks=True)
            src = self.root / "rich" / "source"
            write_source(src, 12_346, 24, seed=3, batch=12_346, excerpts=4, tokens=24,
                         data_sources=("Chat", "Non-Chat"), activation_batch=24)
            batch = src / "explanations" / "batch-0.jsonl.gz"  # every 50th explanation, and 12345's
            keep = [line for line in gzip.decompress(batch.read_bytes()).splitlines()
                    if int(orjson.loads(line)["index"]) % 50 == 0 or orjson.loads(line)["index"] == "12345"]
            batch.write_bytes(gzip.compress(b"\n".join(keep) + b"\n"))
            settings = Settings(warehouse=wh)
            run_ingest([src], settings)
            find.refresh_index(settings)
            return wh
        return self._once("rich", make)

    def _serve(self) -> tuple[str, Path]:
        """The samples published (`featurehouse publish ... --url`) into a folder served on
        loopback, answering Range requests as DuckDB's httpfs needs."""
        from RangeHTTPServer import RangeRequestHandler

        from pipeline.config import Settings
        from pipeline.outputs import publish

        class Handler(RangeRequestHandler):
            def log_message(self, *args):
                pass

        served = self.root / "served"
        served.mkdir()
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        self._server = httpd
        url = f"http://127.0.0.1:{httpd.server_address[1]}/sae"
        publish.publish(Settings(warehouse=self.samples()), served / "sae", url=url)
        return url, served / "sae"

    def folder(self, world: str) -> Path:
        """A new folder as a reader's: ``warehouse/`` (the samples', or with the generated source,
        or a 0.1 single-file warehouse with another in ``old/`` to migrate), their own pages in
        ``captured-pages/`` and an ``inbox/`` of three files that are not pages."""
        with self._lock:
            self._n += 1
            here = self.root / f"{self._n:03d}-{world}"
        here.mkdir()
        if world == "legacy":
            for to in ("warehouse", "old"):
                with tarfile.open(ROOT / "tests" / "legacy" / "warehouse-0.1.tar.gz") as tar:
                    tar.extractall(here / to, filter="data")
            return here
        shutil.copytree(self.rich() if world == "rich" else self.samples(), here / "warehouse", symlinks=True)
        from tests.fake_neuronpedia import small_page

        for index in (901, 902):
            (here / "captured-pages").mkdir(exist_ok=True)
            (here / "captured-pages" / f"{index}.json").write_bytes(orjson.dumps(small_page(index, seed=9)))
        (here / "inbox").mkdir()
        for n in range(3):
            (here / "inbox" / f"note-{n}.txt").write_text(f"a note, not a feature page ({n})\n")
        return here

    # running the examples --------------------------------------------------------------------

    def submit(self, example: Example) -> None:
        key = self._job_key(example)
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = self.pool.submit(self._job, key)

    def outcome(self, example: Example):
        self.submit(example)
        key = self._job_key(example)
        return self._jobs[key].result()[example.line]

    def _job_key(self, e: Example) -> tuple:
        if e.kind == "shell":
            return ("shell", e.page, e.block, e.world)
        if e.kind == "python":
            return ("python", e.page)
        return (e.kind, e.page, e.line)

    def _job(self, key: tuple) -> dict:
        kind, page = key[0], key[1]
        if kind == "shell":
            lines = [e for e in EXAMPLES if (e.kind, e.page, e.block, e.world) == key and not e.skipped]
            here = self.folder(key[3]) if lines else None
            return {e.line: _run(["bash", "-c", self.substitute(e.code)], here, self.env()) for e in lines}
        if kind == "python":
            blocks = [e for e in EXAMPLES if e.kind == "python" and e.page == page]
            return self._python(blocks)
        example = next(e for e in EXAMPLES if (e.kind, e.page, e.line) == key)
        if kind == "sql":
            return {example.line: self._sql(example)}
        if kind == "output":
            return {example.line: _run(["bash", "-c", OUTPUTS[_output_key(example)][1]],
                                       self.folder("reader"), self.env())}
        raise AssertionError(key)

    def _python(self, blocks: list[Example]) -> dict:
        """A page's Python blocks in one interpreter, in order; each block's output or traceback.
        A line :data:`SKIPPED` names is left out (commented out) of its block."""
        code = []
        for e in blocks:
            lines = [f"# skipped: {line}" if any(re.search(p, line) for p in SKIPPED) else line
                     for line in self.substitute(e.code).splitlines()]
            code.append([e.id, "\n".join(lines)])
        r = _run([sys.executable, "-c", SESSION, json.dumps(code)], self.folder(blocks[0].world), self.env())
        try:
            results = json.loads(r.stdout.splitlines()[-1])
        except (IndexError, ValueError):
            raise AssertionError(f"the Python session did not finish: {r.why()}") from None
        return {e.line: Outcome(0 if res["ok"] else 1, res["stdout"], res.get("error", ""), r.seconds)
                for e, res in zip(blocks, results)}

    def _sql(self, e: Example) -> Outcome:
        """A block that attaches a lake itself, in a plain DuckDB client (offline: the
        extensions featurehouse installed, as docs/querying.md says), then a count through the
        name it attached; any other through `featurehouse sql` against the warehouse."""
        sql = self.substitute(e.code)
        here = self.folder(e.world)
        if re.search(r"^\s*ATTACH\b", sql, re.M | re.I):
            alias = re.search(r"\bATTACH\s+'[^']*'\s+AS\s+(\w+)", sql, re.I).group(1)
            first = f"SET extension_directory = '{self.extension_dir}';\n"
            return _run([sys.executable, "-c", CLIENT, first + sql, f"SELECT count(*) FROM {alias}.features"],
                        here, self.env())
        # `--`: a query that starts with a comment (`-- ...`) is not an option
        return _run([FEATUREHOUSE, "sql", "--format", "json", "--", sql], here, self.env())

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


#: Runs a page's Python blocks (``[[name, code], ...]`` in argv[1]) in one namespace, as pasted
#: into one session; prints, last, each block's output and whether it raised.
SESSION = r"""
import contextlib, io, json, sys, traceback
namespace, results = {"__name__": "__main__"}, []
for name, code in json.loads(sys.argv[1]):
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, name, "exec"), namespace)
        results.append({"ok": True, "stdout": printed.getvalue()})
    except BaseException:
        results.append({"ok": False, "stdout": printed.getvalue(), "error": traceback.format_exc()})
sys.stdout.flush()
print("\n" + json.dumps(results))
"""

#: A plain DuckDB client (no featurehouse): the statements of argv[1], then the query argv[2].
CLIENT = r"""
import json, sys, duckdb
con = duckdb.connect()
con.execute(sys.argv[1])
print(json.dumps(con.execute(sys.argv[2]).fetchall()))
"""



def _runs(e: Example) -> bool:
    """Whether the example is a run of its own (a toml block loads in the test; a folder
    listing is looked at)."""
    if e.kind == "output":
        return OUTPUTS[_output_key(e)][0] == "prints"
    return e.kind != "toml" and not (e.kind == "shell" and e.skipped)


def _output_key(e: Example) -> tuple[str, str]:
    first = e.code.splitlines()[0].strip()
    return next(k for k in OUTPUTS if k[0] == e.page and first.startswith(k[1]))


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    """The fake Neuronpedia, the worlds, and the selected examples' runs, started at once."""
    from tests.fake_neuronpedia import FakeNeuronpedia, small_page, small_pages

    pages = small_pages(range(30)) + [small_page(45698), small_page(77369)]  # the indices the pages fetch
    with FakeNeuronpedia(pages=pages, batch_features=16) as fake:
        workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
        run = Runner(tmp_path_factory.mktemp("docs_examples"), fake.base_url, fake.exports_url, workers)
        try:
            chosen = [item.callspec.params["example"] for item in request.session.items
                      if item.module is request.module and hasattr(item, "callspec")
                      and "example" in item.callspec.params]
            for example in chosen:
                if _runs(example):
                    run.submit(example)
            yield run
        finally:
            run.close()


# --- the tests -----------------------------------------------------------------------------


def _stated_json(comment: str):
    """The JSON document a comment shows (``{"status": "succeeded", "n_loaded": ..., ...}``),
    with ``...`` as None; None when it shows none."""
    m = re.search(r"[\[{].*[\]}]", comment)
    if not m or '"' not in m.group(0):
        return None
    text = re.sub(r",\s*\.\.\.\s*([\]}])", r"\1", m.group(0)).replace("...", "null")
    return json.loads(text)


def _agrees(stated, got) -> bool:
    """What the comment states is in what was printed (None: anything)."""
    if stated is None:
        return True
    if isinstance(stated, dict):
        return isinstance(got, dict) and all(k in got and _agrees(v, got[k]) for k, v in stated.items())
    if isinstance(stated, list):
        return isinstance(got, list) and len(got) >= len(stated) and all(map(_agrees, stated, got))
    return stated == got


@pytest.mark.parametrize("example", _of("shell"))
def test_a_shell_command_exits_as_the_page_says(example, runner):
    if example.skipped:
        pytest.skip(example.skipped)
    want = next((code for prefix, (code, _) in EXIT_CODES.items() if example.code.startswith(prefix)), 0)
    got = runner.outcome(example)
    assert got.returncode == want, f"{example.id}: {example.code}\n{got.why()}"
    stated = _stated_json(example.comment)
    if stated is not None:
        assert _agrees(stated, json.loads(got.stdout)), f"{example.id} states {stated}, printed {got.stdout}"
    if example.code.startswith(("featurehouse search", "featurehouse by-token")):  # a find example finds
        assert "(no match)" not in got.stdout, f"{example.id}: {example.code} finds nothing where the page runs it"


@pytest.mark.parametrize("example", _of("sql"))
def test_an_sql_block_runs(example, runner):
    got = runner.outcome(example)
    assert got.returncode == 0, f"{example.id}:\n{example.code}\n{got.why()}"
    if "ATTACH" in example.code:
        assert json.loads(got.stdout)[0][0] > 0, f"{example.id}: the lake it attached holds no feature"


def test_the_tables_page_excerpts_hold_the_peak_and_five_tokens_each_side(runner):
    """docs/tables.md's last query, as `featurehouse sql` shows a block (its last statement)."""
    from tests.conftest import query

    example = next(e for e in EXAMPLES if e.page == "docs/tables.md" and e.kind == "sql")
    got = runner.outcome(example)
    assert got.returncode == 0, got.why()
    rows = json.loads(got.stdout)
    assert len(rows) == 3, rows
    for row in rows:
        [(tokens, peak)] = query(runner.samples(), "SELECT tokens, max_value_token_index FROM activations "
                                                   "WHERE activation_id = ?", [row["activation_id"]])
        assert row["context"] == tokens[max(peak - 5, 0):peak + 6], row


@pytest.mark.parametrize("example", _of("python"))
def test_a_python_block_runs(example, runner):
    got = runner.outcome(example)
    assert got.returncode == 0, f"{example.id}:\n{example.code}\n{got.why()}"


def test_the_great_expectations_rerun_prints_the_checks_the_ingest_quarantined(runner):
    """docs/report.md: "It prints the checks the ingest quarantined records for, each with those
    records' keys (the quarantine table's check_name and record_key)"."""
    from tests.conftest import query

    example = [e for e in EXAMPLES if e.page == "docs/report.md" and e.kind == "python"][-1]
    got = runner.outcome(example)
    assert got.returncode == 0, got.why()
    want = {}
    for check, key in query(runner.samples(), "SELECT check_name, record_key FROM quarantine "
                                              "WHERE record_kind = 'activation' ORDER BY record_key"):
        want.setdefault(check, []).append(key)
    assert want, "the samples quarantine an activation"
    assert sorted(got.stdout.splitlines()) == sorted(f"{c} {k!r}" for c, k in want.items())


@pytest.mark.parametrize("example", _of("toml"))
def test_a_toml_block_loads_as_featurehouse_toml(example, tmp_path):
    from pipeline.sources.plan import load_plan

    whole = [e for e in EXAMPLES if e.page == example.page and e.kind == "toml" and "[[sources]]" in e.code]
    assert len(whole) == 1, f"{example.page}: which block is the whole featurehouse.toml?"
    text = whole[0].code if example is whole[0] else whole[0].code + "\n" + example.code
    path = tmp_path / "featurehouse.toml"
    path.write_text(text)
    plan = load_plan(path, env={})
    assert [(s.model, s.source) for s in plan.sources] == re.findall(
        r'model = "([^"]+)"\nsource = "([^"]+)"', whole[0].code)


@pytest.mark.parametrize("example", _of("output"))
def test_a_shown_output_is_what_the_program_gives(example, runner):
    how, what = OUTPUTS[_output_key(example)]
    if how == "not run":
        pytest.skip(what)
    if how == "prints":
        page = (ROOT / example.page).read_text().splitlines()
        before = " ".join(page[max(example.block - 4, 0):example.block - 1])
        assert f"`{what}`" in before, f"{example.id}: the text before the block no longer names `{what}`"
        got = runner.outcome(example)
        assert got.returncode == 0, got.why()
        assert [line.rstrip() for line in got.stdout.strip().splitlines()] == \
               [line.rstrip() for line in example.code.strip().splitlines()]
        return
    folder = Path(runner.samples() if what == "samples" else runner.served_folder)
    missing = []
    for line in example.code.splitlines()[1:]:
        for entry in re.split(r"\s{2,}", line.strip())[0].split():
            pattern = entry.replace("<table>", "*").rstrip("/")
            found = list(folder.glob(pattern))
            if not found or (entry.endswith("/") and not all(p.is_dir() for p in found)):
                missing.append(entry)
    assert not missing, f"{example.id}: {folder} holds no {missing}"


# --- the lists hold together ---------------------------------------------------------------


def test_every_fenced_block_is_an_example():
    """A block of comments alone, or a listing :data:`OUTPUTS` does not name, would be run as
    nothing, or as a command: every block is accounted for."""
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        starts = {e.block for e in EXAMPLES if e.page == rel and not e.inline}
        assert [s for s, _, _ in _blocks(page)] == sorted(starts), rel
    assert {e.kind for e in EXAMPLES} == {"shell", "sql", "python", "toml", "output", "inline"}


@pytest.mark.parametrize("example", [pytest.param(e, id=e.id) for e in EXAMPLES if e.inline])
def test_an_inline_command_names_a_real_command_and_options(example):
    """Review: the commands written in the pages' sentences were never tried; each names a command
    featurehouse has, with options it takes (the ones that run: test_a_shell_command_exits_...)."""
    why = _parse(example.code)
    assert why is None, f"{example.id}: `{example.code}`: {why}"


def test_the_inline_commands_that_run_are_the_ones_a_reader_can_paste():
    """The rule picks what it should: a command with its own arguments runs, a command named
    alone, or holding a stand-in of capitals, is parsed only."""
    ran = {e.code for e in EXAMPLES if e.inline and e.kind == "shell"}
    assert {"featurehouse by-token cpu --strip --ignore-case", "featurehouse shell --print",
            "featurehouse show gpt-oss-20b/11-resid-post-aa/45698"} <= ran, ran
    assert not ran & {"featurehouse status", "featurehouse show MODEL/SOURCE/INDEX", "featurehouse publish s3://bucket/sae"}
    assert _parse("featurehouse serach x") == "featurehouse has no command 'serach'"
    assert _parse("featurehouse search --limt 3 x") == "featurehouse search has no option --limt"
    assert _parse("featurehouse fetch exports --bogus") == "featurehouse fetch exports has no option --bogus"
    assert _parse("featurehouse -v fetch -v features --help") is None


def test_every_skip_stand_in_and_output_names_something_on_the_pages():
    lines = [line for e in EXAMPLES if e.kind != "output" for line in e.code.splitlines()]
    stale = [p for p in SKIPPED if not any(re.search(p, line) for line in lines)]
    stale += [s for s in STAND_INS if not any(re.search(_word(s), e.code) for e in EXAMPLES)]
    stale += [k for k in OUTPUTS if not any(e.kind == "output" and _output_key(e) == k for e in EXAMPLES)]
    stale += [c for c in EXIT_CODES if not any(e.code.startswith(c) for e in EXAMPLES)]
    assert not stale, f"named in {__name__} but on no page: {stale}"
