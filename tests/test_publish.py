"""featurehouse publish: a snapshot read by readers that have nothing of featurehouse.

A plain DuckDB (httpfs and ducklake loaded from their wheels, no ``pipeline`` import, in its own
process) attaches the published catalog over HTTP (a server that answers Range requests and
counts the bytes it sends) and over S3 (moto's server), and gets exactly the rows the warehouse
holds at that snapshot; pyarrow reads the Hugging Face layout, whose card's YAML names every
file. A later publication sends only new files and a new catalog, and a reader of the old one
keeps reading."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.server
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from RangeHTTPServer import RangeRequestHandler

from pipeline.config import Settings
from pipeline.lake import warehouse as wh
from pipeline.outputs import publish as pub
from pipeline.outputs import publish_s3
from tests.conftest import catalog_held_rebuilding_wal_index, good_page, run_ingest, write
from tests.s3_support import S3_ENV, moto_s3

pytestmark = pytest.mark.xdist_group("publish")
FH = [sys.executable, "-m", "pipeline.cli"]


def _digest(table) -> list:
    """[rows, sha256] of a pyarrow Table's Arrow IPC stream, each column in one chunk and named
    by its position, as two: its validity (booleans) and its values (a fixed-width column's
    nulls as zero: a null slot holds whatever the writer left there, and two reads of equal
    rows differed in it). An IPC stream decodes to the table it encodes, so two equal digests
    are the same types and the same values in the same order: rows whose ``repr`` lists are
    equal. Two different digests prove nothing: ``_same`` then compares the rows themselves.
    Run by the reader too (its source is sent with ``READER``): pyarrow only."""
    import hashlib

    import pyarrow as pa

    class Hashing:  # a file the stream is written to, hashed as it comes (not ~60 MB held and copied)
        closed = False

        def __init__(self):
            self.sha = hashlib.sha256()

        def write(self, b):
            self.sha.update(b)
            return len(b)

        def flush(self):
            pass

        def close(self):
            self.closed = True

    cols = []
    for col in table.columns:
        arr = col.chunks[0] if col.num_chunks == 1 else col.combine_chunks()
        values = arr
        if arr.null_count and pa.types.is_primitive(arr.type):
            values = arr.fill_null(pa.scalar(False if pa.types.is_boolean(arr.type) else 0, arr.type))
        cols += [arr.is_valid(), values]
    canon = pa.table(cols, names=[str(i) for i in range(len(cols))])
    sink = Hashing()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), canon.schema) as w:
        w.write_table(canon)
    return [table.num_rows, sink.sha.hexdigest()]


#: A reader with nothing of featurehouse: DuckDB, its two extensions from their files, one ATTACH.
#: A query named in "digest" gives its rows' number and ``_digest`` (pyarrow), not the rows.
READER = inspect.getsource(_digest) + r"""
import json, sys, duckdb
a = json.loads(sys.argv[1])
c = duckdb.connect(config={"autoinstall_known_extensions": False})
c.execute("SET enable_progress_bar = false")
for p in a["extensions"]:
    c.execute(f"LOAD '{p}'")
if a.get("s3"):
    s = a["s3"]
    c.execute(f"CREATE SECRET (TYPE s3, KEY_ID '{s['key']}', SECRET '{s['secret']}', REGION 'us-east-1', "
              f"ENDPOINT '{s['endpoint']}', URL_STYLE 'path', USE_SSL false)")
c.execute(a["attach"])
out = {}
for name, sql in a["queries"].items():
    if name in a["digest"]:
        out[name] = _digest(c.execute(sql).to_arrow_table())
    else:
        out[name] = [[repr(v) for v in r] for r in c.execute(sql).fetchall()]
assert not any(m == "pipeline" or m.startswith("pipeline.") for m in sys.modules), "the reader imported pipeline"
print(json.dumps(out))
"""


@dataclasses.dataclass(frozen=True, eq=False)
class Read:
    """A query's rows known by their number and ``_digest`` (``built``'s ~6,000 activations were
    ~3 CPU-s to fetch as Python values and ``repr``, each side, and 60 MB of JSON from a reader;
    fetched as Arrow and digested, ~0.7 CPU-s, most of it the ORDER BY both ways keep);
    ``rows()`` reads them again as lists of ``repr``."""

    n: int
    digest: str
    rows: Callable[[], list[list[str]]]

    def __len__(self) -> int:
        return self.n


def _same(got, want, what) -> None:
    """``assert got == want, what`` for rows as read (lists of ``repr``) or as ``Read``: two
    equal digests are equal rows (``_digest``); else the rows themselves are compared, as they
    were before digests (and pytest shows where they differ)."""
    if isinstance(got, Read) and isinstance(want, Read) and (got.n, got.digest) == (want.n, want.digest):
        return
    assert (got.rows() if isinstance(got, Read) else got) == (want.rows() if isinstance(want, Read) else want), what


def _extensions(*names: str) -> list[str]:
    return [wh.extension_path(n) for n in names]


def read_plain(attach: str, queries: dict[str, str], s3: dict | None = None, digest=()) -> dict[str, list | Read]:
    """What the plain reader gets for each query: its rows as lists of ``repr``, or as a ``Read``
    for a query named in ``digest``."""
    args = {"extensions": _extensions("httpfs", "ducklake"), "attach": attach, "queries": queries, "s3": s3,
            "digest": list(digest)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEATUREHOUSE_")}
    p = subprocess.run([sys.executable, "-c", READER, json.dumps(args)], capture_output=True, text=True, env=env,
                       cwd="/", timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    for name in digest:
        out[name] = Read(*out[name], rows=functools.partial(_read_again, attach, name, queries[name], s3))
    return out


def _read_again(attach: str, name: str, sql: str, s3: dict | None) -> list[list[str]]:
    return read_plain(attach, {name: sql}, s3)[name]


class _Counting(RangeRequestHandler):
    def copyfile(self, source, outputfile):
        server = self.server

        class Counter:
            def write(self, b):
                server.sent += len(b)
                return outputfile.write(b)

        return super().copyfile(source, Counter())

    def log_message(self, *args):
        pass


class Served:
    """A folder served over HTTP on loopback, answering Range requests, counting what it sends."""

    def __init__(self, root: Path):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Counting, directory=str(root)))
        self.httpd.sent = 0
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def sent(self) -> int:
        return self.httpd.sent

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def warehouse_rows(settings: Settings, table: str, snapshot: int, drop: tuple[str, ...] = ()) -> list[list[str]]:
    return warehouse_tables(settings, (table,), snapshot, drop)[table]


def warehouse_tables(settings: Settings, tables, snapshot: int, drop: tuple[str, ...] = (),
                     digest=()) -> dict[str, list[list[str]] | Read]:
    """``warehouse_rows`` of each of ``tables`` at ``snapshot``, through one connection (opening
    one is ~0.3 CPU-s: a table a connection was ~75 openings in this module); a table named in
    ``digest`` as a ``Read`` of those rows."""
    out = {}
    with wh.connect(settings, read_only=True) as conn:
        for table in tables:
            cols = [c for c in conn.sql(f"SELECT * FROM {table} LIMIT 0").columns if c not in drop]
            sel = ", ".join(f'"{c}"' for c in cols)
            sql = f"SELECT {sel} FROM {table} AT (VERSION => {snapshot}) ORDER BY ALL"
            if table in digest:
                out[table] = Read(*_digest(conn.execute(sql).to_arrow_table()),
                                  rows=functools.partial(warehouse_rows, settings, table, snapshot, drop))
            else:
                out[table] = [[repr(v) for v in r] for r in conn.execute(sql).fetchall()]
    return out


def _all(tables) -> dict[str, str]:
    return {t: f"SELECT * FROM fh.{t} ORDER BY ALL" for t in tables}


def _loaded(root: Path, n_pages: int) -> Settings:
    """A warehouse in ``root`` of ``n_pages`` realistic pages (each with its bad record) and five
    small ones of another source."""
    from bench.generate import write_pages

    settings = Settings(warehouse=root / "wh")
    pages = write_pages(n_pages, root / "in" / "pages")
    small = [write(root / "in" / "small" / f"{i}.json", orjson.dumps(good_page(i, source="5-res-jb")))
             for i in range(5)]
    run_ingest(pages + small, settings)
    return settings


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A warehouse of 150 realistic pages (three row groups of activations) (each with its bad record) and five small ones of another
    source, published once into a folder that a server serves."""
    root = tmp_path_factory.mktemp("publish")
    settings = _loaded(root, 150)
    server = Served(root)
    yield root, settings, server
    server.close()


def test_a_plain_duckdb_reads_the_published_lake_over_http_exactly(built):
    root, settings, server = built
    dest = root / "pub-http"
    r = pub.publish(settings, dest, url=f"{server.url}/pub-http")
    assert {t.table for t in r.tables} == set(pub.DEFAULT_TABLES)
    assert all(t.how == "new" for t in r.tables)
    attach = next(line for line in r.lines() if line.startswith("ATTACH"))
    assert attach == f"ATTACH 'ducklake:{server.url}/pub-http/featurehouse.ducklake' AS fh (READ_ONLY);"
    got = read_plain(attach, _all(pub.DEFAULT_TABLES), digest=["activations"])
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, r.snapshot_id, digest=["activations"])
    for t in pub.DEFAULT_TABLES:
        want = wants[t]
        _same(got[t], want, t)
        assert want, f"{t} is empty: the comparison proves nothing"
    assert len(got["activations"]) == 150 * 39 + 5 * 3


def test_a_remote_readers_first_query_and_a_lookup_read_little(built):
    """What a reader costs over HTTP, counted at the server: attaching reads the catalog (~1 MB,
    not DuckDB's 256 KiB block a table), a count reads it and at most 1 MB more, and one feature's
    activations read at most 1 MB of data files (sorted by feature, row groups of 2,048 rows)."""
    root, settings, server = built
    dest = root / "pub-bytes"
    r = pub.publish(settings, dest, url=f"{server.url}/pub-bytes", formats=("ducklake",))
    catalog = r.catalog.stat().st_size
    data = sum(p.stat().st_size for p in (dest / "data").rglob("*.parquet"))
    assert catalog < 2_000_000, catalog
    attach = f"ATTACH 'ducklake:{server.url}/pub-bytes/featurehouse.ducklake' AS fh (READ_ONLY)"

    def cost(queries: dict[str, str]) -> tuple[int, dict]:
        before = server.sent
        out = read_plain(attach, queries)
        return server.sent - before, out

    attach_only, _ = cost({"one": "SELECT 1"})
    first, out = cost({"n": "SELECT count(*) FROM fh.features"})
    assert out["n"] == [["155"]]
    assert first <= catalog + 1_000_000, (first, catalog)
    (model, source, index) = warehouse_rows(settings, "features", r.snapshot_id)[20][:3]
    lookup, out = cost({"acts": f"SELECT * FROM fh.activations WHERE model_id = {model} AND source_id = {source} "
                                f"AND feature_index = {index}"})
    assert len(out["acts"]) == 39
    acts = sum(p.stat().st_size for p in (dest / "data" / "main" / "activations").glob("*.parquet"))
    assert lookup - attach_only <= 1_000_000, (lookup, attach_only, data)
    assert lookup - attach_only < 0.6 * acts, f"the lookup read {lookup - attach_only:,} of {acts:,} bytes: no pruning"


def test_a_later_publication_sends_only_new_files_and_a_reader_of_the_old_keeps_reading(built, tmp_path):
    root, settings, server = built
    dest = root / "pub-again"
    first = pub.publish(settings, dest)
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in (dest / "data").rglob("*") if p.is_file()}
    data_bytes = sum(s for s, _ in before.values())
    old_catalog = tmp_path / "old.ducklake"  # a reader that attached the old catalog (its open file)
    os.link(dest / pub.CATALOG_FILE, old_catalog)

    # one new feature of a known source, and one feature captured again with a changed explanation
    page = good_page(100_099)
    changed = good_page(3, source="5-res-jb")
    changed["explanations"][0]["description"] = "gpu things, rewritten"
    run_ingest([write(tmp_path / "new" / "100099.json", orjson.dumps(page)),
                write(tmp_path / "new" / "3.json", orjson.dumps(changed))], settings)
    second = pub.publish(settings, dest)
    assert second.snapshot_id > first.snapshot_id
    how = {t.table: t for t in second.tables}
    assert how["features"].how == "changes" and how["features"].added >= 1
    assert how["explanations"].how == "changes" and how["explanations"].removed == 1
    assert how["models"].how in ("unchanged", "changes")
    # nothing written before was rewritten or removed
    for p, (size, mtime) in before.items():
        assert p.exists() and (p.stat().st_size, p.stat().st_mtime_ns) == (size, mtime), p
    new = [p for p in (dest / "data").rglob("*") if p.is_file() and p not in before]
    new_bytes = sum(p.stat().st_size for p in new)
    # ~2 KB a Parquet file whatever it holds (footer, schema): at this size that is most of it; a
    # table written whole again would be all of data_bytes
    assert new and new_bytes <= 0.05 * data_bytes, (new_bytes, data_bytes)
    # the new catalog gives the warehouse's rows; the old one, what was published first
    local = f"ATTACH 'ducklake:{dest / pub.CATALOG_FILE}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)"
    # (and the publications, the published lake's own history: "p", read by the same reader)
    got = read_plain(local, {**_all(pub.DEFAULT_TABLES), "p": "SELECT snapshot_id FROM fh.publication ORDER BY published_at"},
                     digest=["activations"])
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, second.snapshot_id, digest=["activations"])
    for t in pub.DEFAULT_TABLES:
        _same(got[t], wants[t], t)
    old = read_plain(f"ATTACH 'ducklake:{old_catalog}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)",
                     _all(["features", "explanations"]))
    firsts = warehouse_tables(settings, ("features", "explanations"), first.snapshot_id)
    assert old["features"] == firsts["features"]
    assert old["explanations"] == firsts["explanations"]
    # the publications are the published lake's own history
    assert got["p"] == [[repr(first.snapshot_id)], [repr(second.snapshot_id)]]


def test_the_hugging_face_layout_reads_with_pyarrow_and_its_card_names_every_file(built):
    import pyarrow.parquet as pq
    import yaml

    root, settings, _ = built
    dest = root / "pub-hf"
    r = pub.publish(settings, dest, formats=("hf",), license="cc-by-4.0")
    card = (dest / "hf" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "cc-by-4.0"
    configs = {c["config_name"]: c for c in front["configs"]}
    assert set(configs) == set(pub.DEFAULT_TABLES)
    wants = _counts(settings, r.snapshot_id)  # the warehouse's rows at that snapshot, counted
    for t, c in configs.items():
        pattern = c["data_files"][0]["path"]
        files = sorted((dest / "hf").glob(pattern))
        assert files, pattern
        table = pq.ParquetDataset(files).read()
        assert table.num_rows == wants[t], t
        assert f"`{t}`" in card
    assert "| `max_value` |" in card and "WARN" in card  # columns described; the runs' verdicts (each page has a bad record)
    feats = pq.read_table(dest / "hf" / "features").to_pylist()
    keys = [(f["model_id"], f["source_id"], f["feature_index"]) for f in feats]
    assert keys == sorted(keys)


def test_private_columns_stay_home_unless_asked(built, tmp_path):
    root, settings, _ = built
    r = pub.publish(settings, tmp_path / "p", tables=["runs", "features"], formats=("ducklake",))
    local = f"ATTACH 'ducklake:{r.catalog}' AS fh (READ_ONLY, DATA_PATH '{r.dest}/data/', OVERRIDE_DATA_PATH true)"
    cols = read_plain(local, {"c": "SELECT column_name FROM duckdb_columns() WHERE database_name = 'fh' "
                                   "AND table_name = 'runs'"})["c"]
    names = {eval(c[0]) for c in cols}
    assert names and not names & set(pub.PRIVATE_COLUMNS["runs"]), names
    r2 = pub.publish(settings, tmp_path / "q", tables=["runs"], formats=("ducklake",), include_private=True)
    cols = read_plain(f"ATTACH 'ducklake:{r2.catalog}' AS fh (READ_ONLY, DATA_PATH '{r2.dest}/data/', OVERRIDE_DATA_PATH true)",
                      {"c": "SELECT column_name FROM duckdb_columns() WHERE database_name = 'fh' AND table_name = 'runs'"})["c"]
    assert {"host", "pid"} <= {eval(c[0]) for c in cols}
    # nothing of the landing area leaves
    assert not list(r.dest.rglob("*sha256*"))


def test_publish_refuses_the_warehouse_itself_and_unknown_tables(built):
    root, settings, _ = built
    for bad, why in ((settings.warehouse / "pub", "inside the warehouse"), (root, "holds it")):
        p = subprocess.run([*FH, "publish", str(bad), "--warehouse", str(settings.warehouse)],
                           capture_output=True, text=True)
        assert p.returncode == 1 and why in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run([*FH, "publish", str(root / "x"), "--warehouse", str(settings.warehouse), "--tables", "featres"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "did you mean features" in p.stderr, p.stderr
    assert not (root / "x").exists()


def test_the_printed_line_attaches_as_pasted_and_over_s3(built, tmp_path):
    """The CLI prints the ATTACH line; pasted into a plain DuckDB it opens the folder in place.
    The same folder copied to S3 as `aws s3 sync` would (the catalog last) opens from there."""
    root, settings, _ = built
    dest = tmp_path / "cli"
    p = subprocess.run([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse), "--format", "ducklake"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    line = next(x.strip() for x in p.stdout.splitlines() if x.strip().startswith("ATTACH"))
    got = read_plain(line.rstrip(";"), {"n": "SELECT count(*) FROM fh.activations"})
    snap = _latest(settings)
    wants = warehouse_tables(settings, ("features", "activations"), snap, digest=["activations"])
    assert got["n"] == [[repr(len(wants["activations"]))]]

    with moto_s3() as s3:
        bucket = s3.bucket()
        files = sorted((p for p in dest.rglob("*") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: p.name == pub.CATALOG_FILE)
        for f in files:
            s3.client().upload_file(str(f), bucket, f"pub/{f.relative_to(dest)}")
        secret = {"key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
                  "endpoint": s3.endpoint.removeprefix("http://")}
        got = read_plain(f"ATTACH 'ducklake:s3://{bucket}/pub/featurehouse.ducklake' AS fh "
                         f"(READ_ONLY, DATA_PATH 's3://{bucket}/pub/data/', OVERRIDE_DATA_PATH true)",
                         _all(["features", "activations"]), s3=secret, digest=["activations"])
    assert got["features"] == wants["features"]
    _same(got["activations"], wants["activations"], "activations")


# --- DEST is s3://bucket/prefix ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_server():
    with moto_s3() as srv:
        yield srv


#: The tests of an S3 DEST: an xdist group of their own (beside "publish"), with their own warehouse.
on_s3_group = pytest.mark.xdist_group("publish-s3")


@pytest.fixture(scope="module")
def built_s3(tmp_path_factory):
    """The S3 tests' own warehouse: 40 realistic pages (each with its bad record) and five small
    ones of another source. What those tests prove (what is sent to S3, in parts or not, what is
    left there when a publication fails, what a reader reads from it) holds at any size; a
    quarter of ``built``'s pages publish ~4 times faster, and still make files over the
    multipart test's 64 KiB parts. They add pages to it, which ``built``'s tests do not see."""
    return _loaded(tmp_path_factory.mktemp("publish-s3"), 40)


def _on_s3(settings: Settings, s3_server, monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    return dataclasses.replace(settings, s3_endpoint=s3_server.endpoint), s3_server, s3_server.bucket()


@pytest.fixture
def on_s3(built_s3, s3_server, monkeypatch):
    """The S3 tests' warehouse settings with moto's endpoint (the lake's S3 settings), its
    credentials in the environment, and a bucket of the test's own."""
    return _on_s3(built_s3, s3_server, monkeypatch)


@pytest.fixture
def on_s3_built(built, s3_server, monkeypatch):
    """``on_s3`` of ``built``'s warehouse: for a bound that holds at its size (a later
    publication's new data files, ~2 KB each whatever they hold, are at most 5 % of the first's)."""
    _, settings, _ = built
    return _on_s3(settings, s3_server, monkeypatch)


def _secret(s3) -> dict:
    """The secret a reader has: the bucket's credentials and endpoint, nothing of featurehouse."""
    return {"key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "endpoint": s3.endpoint.removeprefix("http://")}


def _objects(s3, bucket: str, prefix: str) -> dict[str, tuple[str, object, int]]:
    """Every object under the prefix, as listed: key relative to it → (ETag, LastModified, Size)."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:]: (o["ETag"], o["LastModified"], o["Size"])
            for page in pages for o in page.get("Contents", [])}


def _printed_attach(r: pub.Published) -> str:
    return next(x for x in r.lines() if x.startswith("ATTACH")).rstrip(";")


@contextlib.contextmanager
def _puts(settings: Settings):
    """The keys of every PUT (and multipart completion) the publication's S3 client sends."""
    from pipeline.lake import s3 as s3_mod

    sent: list[str] = []
    events = s3_mod.client(settings).meta.events

    def seen(params, **kw):
        sent.append(params["Key"])

    for op in ("PutObject", "CompleteMultipartUpload"):
        events.register(f"before-parameter-build.s3.{op}", seen, unique_id=f"test-puts-{op}")
    try:
        yield sent
    finally:
        for op in ("PutObject", "CompleteMultipartUpload"):
            events.unregister(f"before-parameter-build.s3.{op}", unique_id=f"test-puts-{op}")


def _hf_over_s3(s3, bucket: str, prefix: str, table: str) -> int:
    """Rows of the hf layout's table read from S3 with pyarrow, by the files the card's YAML names."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    import yaml

    card = s3.client().get_object(Bucket=bucket, Key=f"{prefix}/hf/README.md")["Body"].read().decode()
    pattern = {c["config_name"]: c for c in yaml.safe_load(card.split("---")[1])["configs"]}[table]["data_files"][0]["path"]
    folder = pattern.rsplit("/", 1)[0]
    files = sorted(k for k in _objects(s3, bucket, prefix) if k.startswith(f"hf/{folder}/") and k.endswith(".parquet"))
    assert files, pattern
    fs = pafs.S3FileSystem(access_key=S3_ENV["AWS_ACCESS_KEY_ID"], secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                           endpoint_override=s3.endpoint, region="us-east-1", allow_bucket_creation=False)
    return pq.ParquetDataset([f"{bucket}/{prefix}/{k}" for k in files], filesystem=fs).read().num_rows


@on_s3_group
def test_publishing_to_s3_writes_the_folder_layout_and_the_printed_line_reads_it_exactly(on_s3, tmp_path):
    """`publish s3://bucket/prefix` puts there what a folder DEST holds (catalog, data/, hf/);
    a plain DuckDB with the reader's secret pastes the printed ATTACH line and gets every
    table's rows at that snapshot; pyarrow reads hf/ by the files its card names."""
    settings, s3, bucket = on_s3
    r = publish_s3.publish(settings, f"s3://{bucket}/sae/v1", stage=tmp_path / "stage")
    assert r.remote == f"s3://{bucket}/sae/v1" and not r.dry_run
    local = {p.relative_to(r.dest).as_posix(): p.stat().st_size for p in r.dest.rglob("*")
             if p.is_file() and not p.relative_to(r.dest).parts[0].startswith(".")}
    there = _objects(s3, bucket, "sae/v1")
    assert {k: v[2] for k, v in there.items()} == local
    assert pub.CATALOG_FILE in there and "hf/README.md" in there and any(k.startswith("data/main/features/") for k in there)
    assert [k for k, _ in r.upload.sent][-1] == pub.CATALOG_FILE  # last
    assert sorted(k for k, _ in r.upload.sent) == sorted(there) and r.upload.bytes_sent == sum(local.values())

    attach = _printed_attach(r)
    assert attach == f"ATTACH 'ducklake:s3://{bucket}/sae/v1/featurehouse.ducklake' AS fh (READ_ONLY)"
    got = read_plain(attach, _all(pub.DEFAULT_TABLES), s3=_secret(s3), digest=["activations"])
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, r.snapshot_id, digest=["activations"])
    for t in pub.DEFAULT_TABLES:
        want = wants[t]
        _same(got[t], want, t)
        assert want, f"{t} is empty: the comparison proves nothing"
    for t in ("features", "activations"):
        assert _hf_over_s3(s3, bucket, "sae/v1", t) == len(wants[t]), t


def test_a_later_publication_to_s3_sends_only_new_files_and_a_reader_of_the_old_catalog_keeps_reading(on_s3_built, tmp_path):
    """After a one-page load, a publication into the same prefix sends the new data files, the
    hf/ tables that changed and the catalog, nothing else (counted from the listing, and from the
    PUTs sent); a dry run before it says as much and sends nothing; the old catalog still reads
    the first snapshot from the files left in place."""
    settings, s3, bucket = on_s3_built
    stage = tmp_path / "stage"
    dest = f"s3://{bucket}/sae"
    first = publish_s3.publish(settings, dest, stage=stage)
    before = _objects(s3, bucket, "sae")
    s3.client().copy_object(Bucket=bucket, Key="readers/old.ducklake",  # what a reader of the first holds
                            CopySource={"Bucket": bucket, "Key": f"sae/{pub.CATALOG_FILE}"})

    page = good_page(400_001)
    changed = good_page(4, source="5-res-jb")
    changed["explanations"][0]["description"] = "rewritten before the S3 publication"
    run_ingest([write(tmp_path / "n" / "a.json", orjson.dumps(page)),
                write(tmp_path / "n" / "b.json", orjson.dumps(changed))], settings)

    with _puts(settings) as puts:
        dry = publish_s3.publish(settings, dest, stage=stage, dry_run=True)
    assert dry.dry_run and puts == [] and _objects(s3, bucket, "sae") == before
    with _puts(settings) as puts:
        second = publish_s3.publish(settings, dest, stage=stage)
    after = _objects(s3, bucket, "sae")
    new = set(after) - set(before)
    replaced = {k for k in before if k in after and after[k][0] != before[k][0]}
    assert {k.removeprefix("sae/") for k in puts} == new | replaced == {k for k, _ in second.upload.sent}
    # new: data files, and in hf/ the file of the new feature's run of indices, in each table cut by feature
    assert any(k.startswith("data/") for k in new), new
    assert {k for k in new if not k.startswith("data/")} == {
        f"hf/{t}/{_hf_file('11-resid-post-aa', 400_001)}" for t in ("activations", "explanations", "feature_activation_stats",
                                                                     "feature_token_stats")}, new
    assert pub.CATALOG_FILE in replaced and all(k == pub.CATALOG_FILE or k.startswith("hf/") for k in replaced)
    for k, v in before.items():  # no data file was sent again, none removed
        if k.startswith("data/"):
            assert after[k] == v, k
    assert second.upload.fetched == 0  # the stage already held what S3 holds
    # the dry run named as many objects, the same ones but for the new data files' random names
    assert len(dry.upload.sent) == len(second.upload.sent)
    assert {k for k, _ in dry.upload.sent if not k.startswith("data/")} == replaced | {k for k in new if k.startswith("hf/")}
    first_data = sum(v[2] for k, v in before.items() if k.startswith("data/"))
    sent_data = sum(n for k, n in second.upload.sent if k.startswith("data/"))
    assert sent_data <= 0.05 * first_data, (sent_data, first_data)

    # (and the publications, the published lake's own history: "p", read by the same reader)
    got = read_plain(_printed_attach(second), {**_all(pub.DEFAULT_TABLES),
                                               "p": "SELECT snapshot_id FROM fh.publication ORDER BY published_at"},
                     s3=_secret(s3), digest=["activations"])
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, second.snapshot_id, digest=["activations"])
    for t in pub.DEFAULT_TABLES:
        _same(got[t], wants[t], t)
    old = read_plain(f"ATTACH 'ducklake:s3://{bucket}/readers/old.ducklake' AS fh (READ_ONLY)",
                     _all(["features", "explanations"]), s3=_secret(s3))
    firsts = warehouse_tables(settings, ("features", "explanations"), first.snapshot_id)
    assert old["features"] == firsts["features"]
    assert old["explanations"] == firsts["explanations"]
    assert old["explanations"] != got["explanations"]
    assert got["p"] == [[repr(first.snapshot_id)], [repr(second.snapshot_id)]]


@on_s3_group
def test_a_failed_upload_to_s3_leaves_the_publication_there_whole(on_s3, tmp_path, monkeypatch):
    """The connection lost after some data files, then again among hf/'s files: each time the
    catalog there is the one before, and a reader gets the first publication's rows exactly. A
    publication from another stage then (a machine that did not make the one there) fetches it,
    finishes, and both layouts hold the new snapshot."""
    from botocore.exceptions import EndpointConnectionError


    settings, s3, bucket = on_s3
    stage = tmp_path / "stage"
    dest = f"s3://{bucket}/sae"
    first = publish_s3.publish(settings, dest, stage=stage)
    catalog = _objects(s3, bucket, "sae")[pub.CATALOG_FILE]
    run_ingest([write(tmp_path / "n" / "a.json", orjson.dumps(good_page(400_002)))], settings)
    n_data = sum(k.startswith("data/") for k, _ in publish_s3.publish(settings, dest, stage=stage, dry_run=True).upload.sent)
    real_put = publish_s3._put
    # the first snapshot's rows and counts, read once (a snapshot's rows do not change)
    firsts = warehouse_tables(settings, ("features", "explanations"), first.snapshot_id)
    first_counts = _counts(settings, first.snapshot_id)
    for fail_after in (2, n_data + 2):  # among the data files; among hf/'s
        calls = []

        def failing(c, u, rel, path, _after=fail_after, _calls=calls, **cond):
            _calls.append(rel)
            if len(_calls) > _after:
                raise EndpointConnectionError(endpoint_url=s3.endpoint)
            return real_put(c, u, rel, path, **cond)

        monkeypatch.setattr(publish_s3, "_put", failing)
        with pytest.raises(publish_s3.UploadFailed, match="its catalog was not replaced"):
            publish_s3.publish(settings, dest, stage=stage)
        assert _objects(s3, bucket, "sae")[pub.CATALOG_FILE] == catalog
        got = read_plain(f"ATTACH 'ducklake:s3://{bucket}/sae/featurehouse.ducklake' AS fh (READ_ONLY)",
                         {**_all(["features", "explanations"]),
                          **{f"n_{t}": f"SELECT count(*) FROM fh.{t}" for t in pub.DEFAULT_TABLES}}, s3=_secret(s3))
        for t in ("features", "explanations"):
            assert got[t] == firsts[t], (fail_after, t)
        assert {t: int(got[f"n_{t}"][0][0]) for t in pub.DEFAULT_TABLES} == first_counts
    monkeypatch.setattr(publish_s3, "_put", real_put)
    last = publish_s3.publish(settings, dest, stage=tmp_path / "elsewhere")
    assert last.upload.fetched > 0
    got = read_plain(_printed_attach(last), _all(pub.DEFAULT_TABLES), s3=_secret(s3), digest=["activations"])
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, last.snapshot_id, digest=["activations"])
    for t in pub.DEFAULT_TABLES:
        _same(got[t], wants[t], t)
        assert _hf_over_s3(s3, bucket, "sae", t) == len(got[t]), t  # hf/ repaired
    # and the first stage, behind S3 now, takes what S3 holds before building on it
    again = publish_s3.publish(settings, dest, stage=stage)
    assert again.upload.fetched > 0
    got = read_plain(_printed_attach(again), _all(["features", "explanations"]), s3=_secret(s3))
    assert got["features"] == warehouse_rows(settings, "features", again.snapshot_id)


class _Gate(http.server.BaseHTTPRequestHandler):
    """A loopback proxy in front of the S3 server that holds the data-file PUT after ``open`` of
    them (``self.server.held`` set) until ``self.server.release``: a publication caught there
    is caught while sending, every time."""

    protocol_version = "HTTP/1.1"

    def _relay(self) -> None:
        import http.client

        srv = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command == "PUT" and "/data/" in self.path:
            with srv.lock:
                srv.data_puts += 1
                hold = srv.data_puts > srv.open and not srv.release.is_set()
            if hold:
                srv.held.set()
                srv.release.wait(120)
                self.close_connection = True
                return
        conn = http.client.HTTPConnection(*srv.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _gated(s3, open_puts: int):
    host, port = s3.endpoint.removeprefix("http://").split(":")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gate)
    srv.daemon_threads = True
    srv.upstream, srv.open, srv.data_puts = (host, int(port)), open_puts, 0
    srv.lock, srv.held, srv.release = threading.Lock(), threading.Event(), threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


@on_s3_group
def test_a_publication_to_s3_killed_while_sending_leaves_the_one_there_whole(on_s3, tmp_path):
    """`featurehouse publish s3://...` SIGKILLed with two of its new data files sent (the third
    held at a proxy): the catalog there is the one before and a reader gets its rows exactly; the
    next publication (its local folder ahead of S3, its lock freed by the kernel) finishes."""
    settings, s3, bucket = on_s3
    dest = f"s3://{bucket}/sae"
    cache = tmp_path / "cache"
    base = [*FH, "publish", dest, "--warehouse", str(settings.warehouse)]
    with _gated(s3, open_puts=10**6) as (_, endpoint):
        env = {**os.environ, **S3_ENV, "FEATUREHOUSE_S3_ENDPOINT": endpoint, "FEATUREHOUSE_CACHE_DIR": str(cache)}
        p = subprocess.run(base, capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
    first = _latest(settings)
    catalog = _objects(s3, bucket, "sae")[pub.CATALOG_FILE]
    run_ingest([write(tmp_path / "n" / "a.json", orjson.dumps(good_page(400_003)))], settings)
    with _gated(s3, open_puts=2) as (gate, endpoint):
        env = {**os.environ, **S3_ENV, "FEATUREHOUSE_S3_ENDPOINT": endpoint, "FEATUREHOUSE_CACHE_DIR": str(cache)}
        proc = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert gate.held.wait(180), "the publication never sent a third data file"
            proc.kill()
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert gate.data_puts >= 3
        assert _objects(s3, bucket, "sae")[pub.CATALOG_FILE] == catalog
        got = read_plain(f"ATTACH 'ducklake:{dest}/featurehouse.ducklake' AS fh (READ_ONLY)",
                         {**_all(["features"]), **{f"n_{t}": f"SELECT count(*) FROM fh.{t}" for t in pub.DEFAULT_TABLES}},
                         s3=_secret(s3))
        assert got["features"] == warehouse_rows(settings, "features", first)
        assert {t: int(got[f"n_{t}"][0][0]) for t in pub.DEFAULT_TABLES} == _counts(settings, first)
        gate.release.set()
        p = subprocess.run(base, capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
    line = next(x.strip() for x in p.stdout.splitlines() if x.strip().startswith("ATTACH"))
    got = read_plain(line.rstrip(";"), {**_all(["features", "explanations"]),
                                         **{f"n_{t}": f"SELECT count(*) FROM fh.{t}" for t in pub.DEFAULT_TABLES}},
                     s3=_secret(s3))
    snap = _latest(settings)
    wants = warehouse_tables(settings, ("features", "explanations"), snap)
    assert got["features"] == wants["features"]
    assert got["explanations"] == wants["explanations"]
    assert {t: int(got[f"n_{t}"][0][0]) for t in pub.DEFAULT_TABLES} == _counts(settings, snap)


@on_s3_group
def test_files_over_the_part_size_go_up_in_parts_and_are_not_sent_again(on_s3, tmp_path, monkeypatch):
    """Issue 42: the multipart road was never taken by a test (its part size is 64 MiB). With
    parts of 64 KiB (moto told to take parts that small), every file over that goes up in parts:
    S3's ETag is then the MD5 of the parts' MD5s ("-N"), which the next publication must compute
    alike, or it would send every large file again each time; a reader gets the exact rows, and
    no upload is left open."""
    import moto.s3.models

    settings, s3, bucket = on_s3
    monkeypatch.setattr(publish_s3, "PART_SIZE", 64 * 1024)
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1)
    stage, dest = tmp_path / "stage", f"s3://{bucket}/parts"
    first = publish_s3.publish(settings, dest, stage=stage)
    there = _objects(s3, bucket, "parts")
    big = {k for k, (_, _, size) in there.items() if size > 64 * 1024}
    assert pub.CATALOG_FILE in big, there  # the catalog too: its conditional completion included
    assert all(re.search(r'-\d+"?$', there[k][0]) for k in big), {k: there[k][0] for k in big}
    assert all(not re.search(r'-\d+"?$', v[0]) for k, v in there.items() if k not in big)
    assert not s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    got = read_plain(_printed_attach(first), _all(pub.DEFAULT_TABLES), s3=_secret(s3), digest=["activations"])
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, first.snapshot_id, digest=["activations"])
    for t in pub.DEFAULT_TABLES:
        _same(got[t], wants[t], t)

    caches = list(tmp_path.rglob(publish_s3.ETAGS))
    assert caches
    for cache in caches:  # no ETag kept from the upload: each one computed again from the file
        cache.unlink()
    with _puts(settings) as puts:
        again = publish_s3.publish(settings, dest, stage=stage)
    after = _objects(s3, bucket, "parts")
    # what the same snapshot published again sends: its row of the publication table, the catalog
    sent = {k.removeprefix("parts/") for k in puts}
    assert sent == {k for k, _ in again.upload.sent} == (set(after) - set(there)) | {pub.CATALOG_FILE}, sent
    assert all(k.startswith("data/main/publication/") for k in sent - {pub.CATALOG_FILE}), sent
    assert {k: v for k, v in after.items() if k in there and k != pub.CATALOG_FILE} == \
           {k: v for k, v in there.items() if k != pub.CATALOG_FILE}  # every large file kept, none sent again
    assert again.upload.kept == len(there) - 1
    assert again.upload.fetched == 0  # and none fetched back: the stage's files are the objects S3 holds


@on_s3_group
def test_publish_to_s3_from_the_command_line(on_s3, tmp_path):
    """The CLI with the lake's S3 settings (variables): a dry run lists what it would send and
    sends nothing; the publication prints what it sent and an ATTACH line that works as pasted."""
    settings, s3, bucket = on_s3
    env = {**os.environ, **s3.env(), "FEATUREHOUSE_CACHE_DIR": str(tmp_path / "cache")}
    args = [*FH, "publish", f"s3://{bucket}/cli", "--warehouse", str(settings.warehouse), "--format", "ducklake"]
    p = subprocess.run([*args, "--dry-run"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert "would send" in p.stdout and pub.CATALOG_FILE in p.stdout and _objects(s3, bucket, "cli") == {}
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert f"into s3://{bucket}/cli: " in p.stdout and "bytes sent" in p.stdout
    line = next(x.strip() for x in p.stdout.splitlines() if x.strip().startswith("ATTACH"))
    got = read_plain(line.rstrip(";"), {"n": "SELECT count(*) FROM fh.activations"}, s3=_secret(s3))
    assert got["n"] == [[repr(_counts(settings, _latest(settings), ["activations"])["activations"])]]  # its rows, counted
    assert not any(k.startswith("hf/") for k in _objects(s3, bucket, "cli"))


@on_s3_group
def test_an_s3_dest_is_refused_inside_the_lake_or_among_other_objects(on_s3, tmp_path, monkeypatch):
    """Refused in one line, nothing sent: a prefix inside (or holding) the lake's S3 data path, a
    prefix holding objects no publication made, an install without boto3."""
    settings, s3, bucket = on_s3
    lake = dataclasses.replace(settings, data_path=f"s3://{bucket}/lake/data/")
    for dest in (f"s3://{bucket}/lake", f"s3://{bucket}/lake/data/pub"):
        with pytest.raises(pub.PublishRefused, match="inside the warehouse's data path"):
            publish_s3.publish(lake, dest, stage=tmp_path / "stage")
    s3.client().put_object(Bucket=bucket, Key="mine/notes.txt", Body=b"precious")
    with pytest.raises(pub.PublishRefused, match="holds objects no publication made"):
        publish_s3.publish(settings, f"s3://{bucket}/mine", stage=tmp_path / "stage")
    assert _objects(s3, bucket, "mine").keys() == {"notes.txt"}
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "boto3", None)  # the base install: boto3 comes with [scale]
        with pytest.raises(pub.PublishRefused, match=r"pip install 'featurehouse\[scale\]'"):
            publish_s3.publish(settings, f"s3://{bucket}/pub", stage=tmp_path / "stage")
    assert _objects(s3, bucket, "pub") == {}


def _latest(settings: Settings) -> int:
    with wh.connect(settings, read_only=True) as conn:
        return int(conn.execute("SELECT max(snapshot_id) FROM featurehouse.snapshots()").fetchone()[0])


def test_a_publication_killed_part_way_leaves_the_previous_one_whole(built, tmp_path):
    root, settings, _ = built
    dest = tmp_path / "killed"
    first = pub.publish(settings, dest, formats=("ducklake",))
    # the activations at each snapshot, compared by digest (``_same``: ~6,000 rows a read)
    want = warehouse_tables(settings, ("activations",), first.snapshot_id, digest=["activations"])["activations"]
    older = functools.cache(lambda: warehouse_tables(settings, ("activations",), first.snapshot_id - 1,
                                                     digest=["activations"])["activations"])
    run_ingest([write(tmp_path / "more" / "77.json", orjson.dumps(good_page(77)))], settings)
    # killed at several moments of a whole rewrite (--snapshot older than the published: no change feed),
    # counted from when it holds the folder's lock (counted from its start, a loaded machine's
    # imports took the whole delay: the SIGTERM came before the handler that says so, exit -15)
    for delay, sig in ((0.05, signal.SIGKILL), (0.4, signal.SIGTERM), (1.0, signal.SIGKILL), (0.7, signal.SIGTERM)):
        proc = subprocess.Popen([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse), "--format",
                                 "ducklake", "--snapshot", str(first.snapshot_id - 1)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if json.loads((dest / pub.LOCK_FILE).read_bytes() or b"{}").get("pid") == proc.pid:
                    break
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(sig)
        _, err = proc.communicate()
        if sig == signal.SIGTERM and proc.returncode != 0:  # (0: it finished first)
            assert proc.returncode == 143 and "terminated by SIGTERM" in err and "Traceback" not in err, err
        local = f"ATTACH 'ducklake:{dest / pub.CATALOG_FILE}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)"
        got = read_plain(local, {"a": "SELECT * FROM fh.activations ORDER BY ALL",
                                 "p": "SELECT max(snapshot_id) FROM fh.publication"}, digest=["a"])
        if got["p"] == [[repr(first.snapshot_id)]]:
            _same(got["a"], want, (delay, sig))  # the kill came first: the previous publication, whole
        else:  # it finished before the kill: the older snapshot, whole
            _same(got["a"], older(), (delay, sig))
    # the next publication sweeps what the killed ones left (its scratch files, the data files no
    # catalog names), and is whole
    last = pub.publish(settings, dest, formats=("ducklake",))
    assert not [p for p in dest.iterdir() if p.name.startswith(".featurehouse-")]
    named = read_plain(f"ATTACH '{dest / pub.CATALOG_FILE}' AS raw (READ_ONLY)", {"f": """
        SELECT s.path || t.path || f.path FROM (SELECT table_id, path FROM raw.ducklake_data_file
            UNION ALL SELECT table_id, path FROM raw.ducklake_delete_file) f
        JOIN (SELECT DISTINCT table_id, schema_id, path FROM raw.ducklake_table) t USING (table_id)
        JOIN (SELECT DISTINCT schema_id, path FROM raw.ducklake_schema) s USING (schema_id)"""})["f"]
    on_disk = sorted(p.relative_to(dest / "data").as_posix() for p in (dest / "data").rglob("*.parquet"))
    assert on_disk == sorted(eval(f[0]) for f in named)
    local = f"ATTACH 'ducklake:{dest / pub.CATALOG_FILE}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)"
    _same(read_plain(local, {"a": "SELECT * FROM fh.activations ORDER BY ALL"}, digest=["a"])["a"],
          warehouse_tables(settings, ("activations",), last.snapshot_id, digest=["activations"])["activations"], "last")


def test_the_readmes_share_it_lines_work_as_pasted(built):
    """The README's lines, with HOST/PATH the test server's address: DuckDB's ATTACH in a process
    without featurehouse, pandas' read_parquet over HTTP. (`datasets` is not installed here: its
    line is the same files through the `parquet` builder.)"""
    import re as _re

    import pandas as pd

    root, settings, server = built
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Share it", 1)[1].split("\n## ", 1)[0]
    cmd = _re.search(r"`featurehouse publish (\S+) --url (\S+)`", section)
    assert cmd and cmd.group(2) == "https://HOST/PATH"
    base = f"{server.url}/share"
    r = pub.publish(settings, root / "share", url=base)
    attach = _re.search(r"^(ATTACH .*?);", section, _re.M).group(1).replace("https://HOST/PATH", base)
    got = read_plain(attach, {"n": "SELECT count(*) FROM fh.features"})
    n = len(warehouse_rows(settings, "features", r.snapshot_id))
    assert got["n"] == [[repr(n)]]
    line = _re.search(r"^pd\.read_parquet\('([^']+)'\)", section, _re.M).group(1).replace("https://HOST/PATH", base)
    assert len(pd.read_parquet(line)) == n
    assert "datasets.load_dataset('parquet', data_files='https://HOST/PATH/hf/features/*.parquet')" in section


def test_a_publication_holds_the_tables_it_names_and_no_others(built, tmp_path):
    root, settings, _ = built
    dest = tmp_path / "narrow"
    pub.publish(settings, dest)
    r = pub.publish(settings, dest, tables=["features", "models"])
    local = f"ATTACH 'ducklake:{r.catalog}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)"
    got = read_plain(local, {"t": "SELECT table_name FROM duckdb_tables() WHERE database_name = 'fh' ORDER BY 1"})
    assert [eval(t[0]) for t in got["t"]] == ["features", "models", "publication"]
    assert sorted(p.name for p in (dest / "hf").iterdir() if p.is_dir()) == ["features", "models"]
    assert read_plain(local, {"n": "SELECT count(*) FROM fh.features"})["n"] == \
        [[repr(len(warehouse_rows(settings, "features", r.snapshot_id)))]]


def _hf_rows(dest: Path, table: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetDataset(sorted((dest / "hf" / table).glob("*.parquet"))).read().num_rows


def test_hf_follows_the_snapshot_after_a_ducklake_only_publication(built, tmp_path):
    """Found from outside: `--format ducklake` then `both` left hf/ at the older snapshot for good
    (the DuckLake said 'unchanged', which says nothing of hf/)."""
    root, settings, _ = built
    dest = tmp_path / "mixed"
    pub.publish(settings, dest)
    run_ingest([write(tmp_path / "n" / "1.json", orjson.dumps(good_page(200_001)))], settings)
    pub.publish(settings, dest, formats=("ducklake",))
    r = pub.publish(settings, dest)
    wants = _counts(settings, r.snapshot_id, ("features", "activations", "explanations"))  # its rows, counted
    for t in ("features", "activations", "explanations"):
        assert _hf_rows(dest, t) == wants[t], t


def test_a_warehouse_restored_from_a_copy_is_published_whole(built, tmp_path):
    """Found from outside: a restored warehouse numbers its snapshots again; the change feed from
    'the same' snapshot id applied another timeline's rows."""
    import shutil

    root, settings, _ = built
    copy = Settings(warehouse=tmp_path / "wh")
    shutil.copytree(settings.warehouse, copy.warehouse)
    backup = tmp_path / "backup"
    shutil.copytree(copy.warehouse, backup)
    live = good_page(5, source="5-res-jb")
    live["explanations"][0]["description"] = "the live timeline"
    run_ingest([write(tmp_path / "live" / "5.json", orjson.dumps(live))], copy)
    dest = tmp_path / "timeline"
    pub.publish(copy, dest, formats=("ducklake",))
    shutil.rmtree(copy.warehouse)
    shutil.copytree(backup, copy.warehouse)
    restored = good_page(5, source="5-res-jb")
    restored["explanations"][0]["description"] = "the restored timeline"
    run_ingest([write(tmp_path / "restored" / "5.json", orjson.dumps(restored))], copy)
    r = pub.publish(copy, dest, formats=("ducklake",))
    assert {t.how for t in r.tables} == {"whole"}, [(t.table, t.how, t.why) for t in r.tables]
    local = f"ATTACH 'ducklake:{r.catalog}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)"
    got = read_plain(local, _all(["explanations", "features"]))
    assert got["explanations"] == warehouse_rows(copy, "explanations", r.snapshot_id)


def test_paths_and_unrelated_folders_stay_safe(built, tmp_path):
    """Found from outside: run_inputs.origin and raw_inputs.landed_path leaked paths; a folder with
    an hf/ of its own lost it; a link into the warehouse passed as outside it; s3:// became a
    local folder (now: the bucket is looked for, and its absence said in one line)."""
    root, settings, _ = built
    r = pub.publish(settings, tmp_path / "p", tables=["raw_inputs", "run_inputs"])
    local = f"ATTACH 'ducklake:{r.catalog}' AS fh (READ_ONLY, DATA_PATH '{r.dest}/data/', OVERRIDE_DATA_PATH true)"
    every = read_plain(local, _all(["raw_inputs", "run_inputs"]))
    assert every["raw_inputs"] and every["run_inputs"]
    assert str(tmp_path.parent) not in json.dumps(every) and "/tmp" not in json.dumps(every)
    mine = tmp_path / "mine"
    write(mine / "hf" / "my-model" / "weights.bin", b"precious")
    p = subprocess.run([*FH, "publish", str(mine), "--warehouse", str(settings.warehouse)], capture_output=True, text=True)
    assert p.returncode == 1 and "holds other files" in p.stderr and (mine / "hf" / "my-model" / "weights.bin").exists()
    link = tmp_path / "link"
    link.symlink_to(settings.warehouse)
    p = subprocess.run([*FH, "publish", str(link / "pub"), "--warehouse", str(settings.warehouse)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "inside the warehouse" in p.stderr, p.stderr
    with moto_s3() as s3:
        env = {**os.environ, **s3.env(), "FEATUREHOUSE_CACHE_DIR": str(tmp_path / "cache")}
        p = subprocess.run([*FH, "publish", "s3://no-such-bucket/x", "--warehouse", str(settings.warehouse)],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert p.returncode == 1 and "cannot list s3://no-such-bucket/x" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "s3:").exists()


# --- killed at real points, then published again ----------------------------------------------------

def _parquet(dest: Path, hf: bool) -> set[tuple[int, int]]:
    """The Parquet files under DEST, of the hf layout (``hf/`` and any folder staging it) or of the
    DuckLake (the rest): (inode, mtime), so a hard link to a file already there is not a new one."""
    out = set()
    for root, _, files in os.walk(dest):
        top = (Path(root).relative_to(dest).parts or ("",))[0]
        if (top == "hf" or top.endswith("-hf")) == hf:
            for f in files:
                if f.endswith(".parquet"):
                    try:
                        st = os.stat(os.path.join(root, f))
                    except OSError:  # removed as it was seen
                        continue
                    out.add((st.st_ino, st.st_mtime_ns))
    return out


def _inode(p: Path) -> int | None:
    try:
        return p.stat().st_ino
    except OSError:
        return None


#: Where a publication is killed, as seen from outside: (name, test) where test(dest, before) is true
#: once the point is passed; ``before`` is what DEST held when the publication started.
POINTS = {
    "lock taken": lambda d, b: (d / pub.LOCK_FILE).exists(),
    "catalog copy begun": lambda d, b: any(d.glob(".featurehouse-*.ducklake")),
    "1 data file": lambda d, b: len(_parquet(d, False) - b["ducklake"]) >= 1,
    "5 data files": lambda d, b: len(_parquet(d, False) - b["ducklake"]) >= 5,
    "catalog replaced": lambda d, b: _inode(d / pub.CATALOG_FILE) not in (None, b["catalog"]),
    "1 hf file": lambda d, b: len(_parquet(d, True) - b["hf"]) >= 1,
    "5 hf files": lambda d, b: len(_parquet(d, True) - b["hf"]) >= 5,
}


def _kill_at(settings: Settings, dest: Path, point: str, *args: str) -> bool:
    """Run ``featurehouse publish DEST`` and SIGKILL it as soon as ``point`` is passed (looked at
    every millisecond or so); False when it ended before."""
    before = {"ducklake": _parquet(dest, False), "hf": _parquet(dest, True), "catalog": _inode(dest / pub.CATALOG_FILE)}
    if point == "lock taken":
        with contextlib.suppress(FileNotFoundError):
            (dest / pub.LOCK_FILE).unlink()  # (left by the last one: the test is its coming back)
    proc = subprocess.Popen([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if dest.is_dir() and POINTS[point](dest, before):
                proc.kill()
                proc.communicate()
                return True
            time.sleep(0.001)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"not killed at {point!r}: the publication failed: {err[-2000:]}"
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _counts(settings: Settings, snapshot: int, tables=pub.DEFAULT_TABLES) -> dict[str, int]:
    with wh.connect(settings, read_only=True) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t} AT (VERSION => {snapshot})").fetchone()[0] for t in tables}


def _attach(dest: Path) -> str:
    """As docs/publishing.md says a reader opens a folder in place."""
    return f"ATTACH 'ducklake:{dest / pub.CATALOG_FILE}' AS fh (READ_ONLY, DATA_PATH '{dest}/data/', OVERRIDE_DATA_PATH true)"


def _what_readers_see(settings: Settings, dest: Path, counts=None) -> tuple[int | None, int | None]:
    """The snapshot the DuckLake and the hf layout hold (None: nothing there), each checked whole:
    every table has the warehouse's rows at that snapshot, and hf/ is what its card says.
    ``counts(snapshot)``: ``_counts`` at a snapshot (a test that looks again and again passes one
    that remembers them: a snapshot's rows do not change, and each look was two connections)."""
    import re as _re

    import pyarrow.parquet as pq

    counts = counts or functools.partial(_counts, settings)
    lake = None
    if (dest / pub.CATALOG_FILE).exists():
        q = {t: f"SELECT count(*) FROM fh.{t}" for t in pub.DEFAULT_TABLES}
        got = read_plain(_attach(dest), {**q, "snap": "SELECT max(snapshot_id) FROM fh.publication"})
        lake = int(got.pop("snap")[0][0])
        assert {t: int(v[0][0]) for t, v in got.items()} == counts(lake), "the DuckLake is not one snapshot"
    else:  # nothing a reader opens: no data file where the catalog's would be
        assert not list((dest / "data").rglob("*.parquet"))
    hf = None
    if (dest / "hf").exists():
        card = (dest / "hf" / "README.md").read_text()  # a reader's way in: its configs
        hf = int(_re.search(r"warehouse snapshot (\d+)", card).group(1))
        mark = json.loads((dest / "hf" / pub.HF_MARK).read_text())["tables"]
        assert set(mark) == set(pub.DEFAULT_TABLES) and len(set(mark.values())) == 1, mark
        got = {t: pq.ParquetDataset(sorted((dest / "hf" / t).glob("*.parquet"))).read().num_rows
               for t in pub.DEFAULT_TABLES}
        assert got == counts(hf), "hf/ holds tables of two snapshots"
        for t, n in got.items():
            assert f"| `{t}` | {n:,} |" in card, t
    return lake, hf


def _no_leftovers(dest: Path) -> None:
    assert not [p for p in dest.rglob(".featurehouse-*")], sorted(dest.rglob(".featurehouse-*"))
    named = read_plain(f"ATTACH '{dest / pub.CATALOG_FILE}' AS raw (READ_ONLY)", {"f": """
        SELECT s.path || t.path || f.path FROM (SELECT table_id, path FROM raw.ducklake_data_file
            UNION ALL SELECT table_id, path FROM raw.ducklake_delete_file) f
        JOIN (SELECT DISTINCT table_id, schema_id, path FROM raw.ducklake_table) t USING (table_id)
        JOIN (SELECT DISTINCT schema_id, path FROM raw.ducklake_schema) s USING (schema_id)"""})["f"]
    on_disk = sorted(p.relative_to(dest / "data").as_posix() for p in (dest / "data").rglob("*.parquet"))
    assert on_disk == sorted(eval(f[0]) for f in named), "data files no catalog names are left"


def test_a_first_publication_killed_anywhere_leaves_nothing_and_the_next_finishes(built, tmp_path):
    """Found from outside: a first publication killed part-way (SIGKILL) left its lock, a part of
    data/ and its catalog copy, and every publication into that folder after it was refused ('holds
    other files'). Killed at each point in turn (each coming back to what the one before left),
    the folder holds nothing a reader opens; the next publication removes what they left, even a
    copy named for a process id that is alive again, and publishes."""
    root, settings, _ = built
    dest = tmp_path / "first"
    snap = _latest(settings)
    counts = functools.cache(functools.partial(_counts, settings))  # by snapshot: they do not change
    for point in ("lock taken", "catalog copy begun", "1 data file", "5 data files", "catalog replaced", "1 hf file"):
        killed = _kill_at(settings, dest, point)
        assert killed or point in ("catalog replaced", "1 hf file"), f"it finished before {point!r}"
        lake, hf = _what_readers_see(settings, dest, counts)
        if point in ("catalog replaced", "1 hf file"):
            assert lake == snap and hf in (None, snap)
        else:
            assert (lake, hf) == (None, None), point
    # a dead publisher's process id may be a live process's by now: what it left goes all the same
    write(dest / f".featurehouse-{os.getpid()}-1.ducklake", b"left by a publication killed long ago")
    p = subprocess.run([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse)], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert _what_readers_see(settings, dest, counts) == (snap, snap)
    _no_leftovers(dest)
    line = next(x.strip() for x in p.stdout.splitlines() if x.strip().startswith("ATTACH"))
    got = read_plain(line.rstrip(";"), {t: f"SELECT count(*) FROM fh.{t}" for t in pub.DEFAULT_TABLES})
    assert {t: int(v[0][0]) for t, v in got.items()} == counts(snap)


def test_a_later_publication_killed_anywhere_leaves_the_one_before_whole(built, tmp_path):
    """Killed at each point of a publication that applies the change feed and rewrites hf/'s
    changed tables: each layout is the publication before, whole, or (killed once its catalog was
    in) the new one, whole; hf/ is never some tables of each (it was: each table replaced in turn,
    the card last). The next publication finishes and leaves nothing behind."""
    root, settings, _ = built
    dest = tmp_path / "later"
    first = pub.publish(settings, dest)
    page = good_page(300_001)
    changed = good_page(2, source="5-res-jb")
    changed["explanations"][0]["description"] = "rewritten for the kill test"
    run_ingest([write(tmp_path / "n" / "a.json", orjson.dumps(page)),
                write(tmp_path / "n" / "b.json", orjson.dumps(changed))], settings)
    snap = _latest(settings)
    counts = functools.cache(functools.partial(_counts, settings))  # by snapshot: they do not change
    assert counts(snap) != counts(first.snapshot_id)
    for point in ("catalog copy begun", "1 data file", "catalog replaced", "1 hf file", "5 hf files"):
        assert _kill_at(settings, dest, point), f"it finished before {point!r}"
        lake, hf = _what_readers_see(settings, dest, counts)
        assert lake in (first.snapshot_id, snap) and hf == first.snapshot_id, (point, lake, hf)
    p = subprocess.run([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse)], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert _what_readers_see(settings, dest, counts) == (snap, snap)
    _no_leftovers(dest)
    hist = read_plain(_attach(dest), {"p": "SELECT snapshot_id FROM fh.publication ORDER BY published_at"})
    assert hist["p"][0] == [repr(first.snapshot_id)] and hist["p"][-1] == [repr(snap)]


def test_a_publication_under_way_is_named_and_left_alone(built, tmp_path):
    """A second publication into a folder while a live process publishes there (stopped with
    SIGSTOP, its lock held) is refused, naming that process; a dry run meanwhile writes nothing
    there; neither removes what the first has written so far, and it finishes whole."""
    root, settings, _ = built
    dest = tmp_path / "busy"
    pub.publish(settings, dest, formats=("ducklake",))
    run_ingest([write(tmp_path / "n" / "c.json", orjson.dumps(good_page(300_002)))], settings)
    snap = _latest(settings)
    with _stopped_mid_copy(settings, dest) as a:  # (then let go on: it finishes whole)
        its = sorted(p.name for p in dest.rglob("*"))
        b = subprocess.run([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse)], capture_output=True,
                           text=True)
        assert b.returncode == 1 and "under way" in b.stderr and f"process {a.pid} on " in b.stderr, b.stderr
        assert "Traceback" not in b.stderr
        d = subprocess.run([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse), "--dry-run"],
                           capture_output=True, text=True)
        assert d.returncode == 0, d.stderr
        assert sorted(p.name for p in dest.rglob("*")) == its
    assert _what_readers_see(settings, dest)[0] == snap
    _no_leftovers(dest)


@contextlib.contextmanager
def _stopped_mid_copy(settings: Settings, dest: Path):
    """``featurehouse publish`` of the warehouse into ``dest`` in a process of its own (the
    block's value), stopped (SIGSTOP) once it holds the folder's lock and has begun its catalog
    copy, and not while it rebuilds the catalog's WAL index: no reader could read the warehouse
    then, whatever featurehouse does (``test_a_publication_under_way_is_refused_at_once...``
    holds that state). When the block ends it is let go on, and must finish (exit 0)."""
    a = subprocess.Popen([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse), "--format", "ducklake"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(dest.glob(f".featurehouse-{a.pid}-*.ducklake")):  # its lock held, its catalog copy begun
            assert a.poll() is None and time.monotonic() < deadline, "the publication ended before it was stopped"
            time.sleep(0.001)
        os.kill(a.pid, signal.SIGSTOP)
        while _rebuilding_its_wal_index(a.pid, settings):
            os.kill(a.pid, signal.SIGCONT)
            time.sleep(0.001)
            os.kill(a.pid, signal.SIGSTOP)
        yield a
        os.kill(a.pid, signal.SIGCONT)
        _, err = a.communicate(timeout=120)
        assert a.returncode == 0, err
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()


def _rebuilding_its_wal_index(pid: int, settings: Settings) -> bool:
    """Whether process ``pid`` holds a lock of the catalog's WAL index for writing (/proc/locks): a
    reader opening the catalog alone rebuilds the index, and if stopped meanwhile every other reader
    fails (``conftest.catalog_held_rebuilding_wal_index``): a dry run cannot read the warehouse then, whatever featurehouse does."""
    time.sleep(0.01)  # (stopped: its locks are what they will stay)
    try:
        shm = os.stat(settings.warehouse / "catalog.sqlite-shm").st_ino
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()  # 1: POSIX  ADVISORY  WRITE 1234 08:01:5678 120 122
        if len(f) >= 8 and f[3] == "WRITE" and f[4] == str(pid) and int(f[5].rsplit(":", 1)[1]) == shm:
            return True
    return False


def test_a_publication_under_way_is_refused_at_once_whatever_it_holds_of_the_warehouse(built, tmp_path):
    """Found on a loaded run of the test above: the second publication failed with SQLite's "locking
    protocol" instead of "under way" (it opened the warehouse before it looked at the folder's lock,
    and the first was stopped while it held the catalog, rebuilding its WAL index). With the first
    stopped holding its lock and the catalog so held, the second is refused at once, naming it, and
    the first finishes."""
    root, settings, _ = built
    dest = tmp_path / "busy"
    pub.publish(settings, dest, formats=("ducklake",))
    with _stopped_mid_copy(settings, dest) as a:  # (then let go on: it finishes whole)
        with catalog_held_rebuilding_wal_index(settings):
            started = time.monotonic()
            b = subprocess.run([*FH, "publish", str(dest), "--warehouse", str(settings.warehouse)],
                               capture_output=True, text=True)
            took = time.monotonic() - started
        assert b.returncode == 1 and "under way" in b.stderr and f"process {a.pid} on " in b.stderr, b.stderr
        assert took < 30, f"refused after {took:.0f} s"
    assert _what_readers_see(settings, dest)[0] == _latest(settings)


def _hf_file(source: str, index: int, model: str = "gpt-oss-20b") -> str:
    """The hf layout's file for a feature of a table cut by source and feature (``publish_hf_files._chunk_sql``)."""
    import hashlib

    digest = hashlib.md5(f"{model}\x00{source}".encode()).hexdigest()[:12]
    return f"{digest}-{index // pub.HF_CHUNK:07d}.parquet"


def test_a_later_hf_publication_rewrites_only_the_files_of_the_features_that_changed(tmp_path):
    """The hf layout is cut by source and runs of HF_CHUNK features: after a load, the files of the
    features it did not touch are the files before (hard links: not written, not sent again);
    those it touched are written anew, a new run's file appears, a removed row leaves; and every
    table reads back as the warehouse holds it at the new snapshot."""
    import pyarrow.parquet as pq

    settings = Settings(warehouse=tmp_path / "wh")
    src = "5-res-jb"
    run_ingest([write(tmp_path / "in" / f"{i}.json", orjson.dumps(good_page(i, source=src)))
                for i in (1, 2, 2 * pub.HF_CHUNK + 1, 4 * pub.HF_CHUNK + 1)]
               + [write(tmp_path / "in" / "other.json", orjson.dumps(good_page(3)))], settings)
    dest = tmp_path / "pub"
    first = pub.publish(settings, dest)
    chunked = ["activations", "explanations", "feature_activation_stats", "feature_token_stats"]
    before = {p.relative_to(dest / "hf"): p.stat().st_ino for p in (dest / "hf").rglob("*.parquet")}
    for t in chunked:
        assert {p.name for p in (dest / "hf" / t).glob("*.parquet")} == {
            _hf_file(src, 1), _hf_file(src, 2 * pub.HF_CHUNK), _hf_file(src, 4 * pub.HF_CHUNK), _hf_file("11-resid-post-aa", 3)}, t

    # feature 4*CHUNK+1 captured again with one activation fewer and a new explanation; a feature of a new run of indices
    again = good_page(4 * pub.HF_CHUNK + 1, source=src)
    again["activations"] = again["activations"][:2]
    again["explanations"][0]["description"] = "rewritten"
    run_ingest([write(tmp_path / "in2" / "again.json", orjson.dumps(again)),
                write(tmp_path / "in2" / "new.json", orjson.dumps(good_page(6 * pub.HF_CHUNK, source=src)))], settings)
    second = pub.publish(settings, dest)
    assert second.snapshot_id > first.snapshot_id
    after = {p.relative_to(dest / "hf"): p.stat().st_ino for p in (dest / "hf").rglob("*.parquet")}
    for t in chunked:
        kept = [Path(t) / _hf_file(src, 1), Path(t) / _hf_file(src, 2 * pub.HF_CHUNK), Path(t) / _hf_file("11-resid-post-aa", 3)]
        assert all(after[k] == before[k] for k in kept), t  # the same files: untouched
        touched = Path(t) / _hf_file(src, 4 * pub.HF_CHUNK)
        assert after[touched] != before[touched], t
        assert Path(t) / _hf_file(src, 6 * pub.HF_CHUNK) in after, t
    assert after[Path("features/data_0.parquet")] != before[Path("features/data_0.parquet")]
    wants = warehouse_tables(settings, pub.DEFAULT_TABLES, second.snapshot_id)
    for t in pub.DEFAULT_TABLES:
        files = sorted((dest / "hf" / t).glob("*.parquet"))
        got = pq.ParquetDataset(files).read().to_pylist()
        assert len(got) == len(wants[t]), t
    acts = pq.ParquetDataset(sorted((dest / "hf" / "activations").glob("*.parquet"))).read().to_pylist()
    assert sum(a["feature_index"] == 4 * pub.HF_CHUNK + 1 for a in acts) == 2
    expl = pq.read_table(dest / "hf" / "explanations" / _hf_file(src, 4 * pub.HF_CHUNK)).to_pylist()
    assert [e["description"] for e in expl] == ["rewritten"]
    # each file sorted by feature: a lookup reads the row group that holds it
    for f in (dest / "hf" / "activations").glob("*.parquet"):
        keys = [(r["model_id"], r["source_id"], r["feature_index"]) for r in pq.read_table(f).to_pylist()]
        assert keys == sorted(keys), f
    # the hf bytes written the second time: the touched and new files and the card, not the whole layout
    hf_total = sum(p.stat().st_size for p in (dest / "hf").rglob("*") if p.is_file())
    assert second.bytes_by_format["hf"] < 0.75 * hf_total
    assert second.bytes_by_format["hf"] == sum(
        (dest / "hf" / k).stat().st_size for k, ino in after.items() if before.get(k) != ino) + len(
        (dest / "hf" / "README.md").read_bytes())
    # published again with nothing new: every file kept
    third = pub.publish(settings, dest)
    assert {p.relative_to(dest / "hf"): p.stat().st_ino for p in (dest / "hf").rglob("*.parquet")} == after
    assert third.bytes_by_format.get("hf", 0) == len((dest / "hf" / "README.md").read_bytes())


def test_an_emptied_or_filled_hf_table_keeps_no_stale_file(tmp_path):
    """A table cut by feature that was empty (one file of its columns) and then holds rows has
    only its rows' files after, and one emptied again only the file of its columns."""
    import pyarrow.parquet as pq

    settings = Settings(warehouse=tmp_path / "wh")
    bare = good_page(1, source="5-res-jb")
    bare["activations"] = []
    run_ingest([write(tmp_path / "in" / "1.json", orjson.dumps(bare))], settings)
    dest = tmp_path / "pub"
    pub.publish(settings, dest, formats=("hf",))
    assert [p.name for p in (dest / "hf" / "activations").glob("*.parquet")] == ["data_0.parquet"]
    run_ingest([write(tmp_path / "in2" / "1.json", orjson.dumps(good_page(1, source="5-res-jb")))], settings)
    r = pub.publish(settings, dest, formats=("hf",))
    assert [p.name for p in (dest / "hf" / "activations").glob("*.parquet")] == [_hf_file("5-res-jb", 1)]
    assert pq.read_table(dest / "hf" / "activations").num_rows == len(warehouse_rows(settings, "activations", r.snapshot_id))


def test_an_empty_table_has_its_file_but_no_config_datasets_would_refuse(built, tmp_path):
    """`datasets.load_dataset(hf, 'fetch_failures')` failed on a table with no rows ("train
    corresponds to no data"): the card names a config for each table with rows only, and says
    the empty one is empty; its file (its columns) is there for pyarrow."""
    import pyarrow.parquet as pq
    import yaml

    _, settings, _ = built
    r = pub.publish(settings, tmp_path / "p", tables=["features", "fetch_failures"], formats=("hf",))
    card = (r.dest / "hf" / "README.md").read_text()
    configs = {c["config_name"] for c in yaml.safe_load(card.split("---")[1])["configs"]}
    assert configs == {"features"}
    assert "| `fetch_failures` | 0 (empty: no config) |" in card
    empty = pq.read_table(r.dest / "hf" / "fetch_failures")
    assert empty.num_rows == 0 and "url" not in empty.column_names and "feature_key" in empty.column_names  # (url: private)
