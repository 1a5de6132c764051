"""A fake Neuronpedia on 127.0.0.1: the feature API and an S3-style export bucket, with faults.

Serves, from a list of API-JSON pages (``bench.generate.synthetic_page`` shapes):

- ``GET  /api/feature/{model}/{source}/{index}``   one page, or 404 ``{"error": ...}``
- ``POST /api/features-offset``                     ``{"modelId","layer","offset"}`` -> up to 25 pages
- ``GET  /{bucket}/?list-type=2&prefix=&max-keys=&continuation-token=``  ListObjectsV2 XML
- ``GET  /{bucket}/v1/{model}/{source}/...``        model/source/sourceset.jsonl, batch-N.jsonl.gz

Faults are injected per request path (``faults={path: ["429", "drop"]}`` answers the first
request for ``path`` with a 429, the second by dropping the connection mid-body, and the rest
normally; ``always={path: "503"}`` fails every time). Kinds: ``429`` (with ``Retry-After``),
``500``, ``503``, ``slow`` (answers after ``slow_seconds``, past a client's timeout), ``drop``
(full Content-Length, half the body, then the connection closes), ``reset`` (closes without an
answer), ``truncate`` (half the body with a matching Content-Length: a cut gzip or JSON),
``corrupt`` (full length, one byte of the gzip CRC flipped), ``404``, and ``echo_key_500`` (a 500 whose body repeats the ``x-api-key`` it received). Every
request is recorded (method, path, query, headers, body, time, how it was answered).

    with FakeNeuronpedia(pages=small_pages(range(20))) as np:
        fetch_features("gpt-oss-20b", "11-resid-post-aa", range(20), base_url=np.base_url)

Standalone: ``python -m tests.fake_neuronpedia --port 8765 --n-features 200 [--fault-rate 0.1]``.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import random
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

import orjson

from bench.generate import synthetic_page

MODEL = "gpt-oss-20b"
SOURCE = "11-resid-post-aa"
FAULT_KINDS = ("429", "500", "503", "slow", "drop", "reset", "truncate", "corrupt", "404", "echo_key_500", "trickle")
RANDOM_FAULT_KINDS = ("429", "500", "503", "slow", "drop", "reset", "truncate")
PAGE_SIZE = 25
_RELATIONS = {"model", "source", "sourceSet", "activations", "explanations", "lists", "creator", "comments"}

# Producer "a" writes the documented minimal columns; producer "b" writes every column the API
# has plus extras of its own. The pipeline must read both by name.
ACTIVATION_COLUMNS_A = (
    "id", "modelId", "layer", "index", "creatorId", "dataSource", "tokens", "maxValue", "minValue",
    "values", "maxValueTokenIndex", "dfaValues", "dfaMaxValue", "dfaTargetIndex", "binContains",
    "binMin", "binMax",
)
EXPLANATION_COLUMNS = (
    "id", "modelId", "layer", "index", "authorId", "description", "embedding", "typeName",
    "explanationModelName", "umap_x", "umap_y", "umap_cluster", "umap_log_feature_sparsity",
)


# --- fixture pages --------------------------------------------------------------------------


def small_page(index: int, *, n_activations: int = 3, n_tokens: int = 24, seed: int = 0,
               model: str = MODEL, source: str = SOURCE) -> dict:
    """``synthetic_page`` cut down for speed: a few activations, each a short window of tokens
    around its strongest one (maxValue, its index and minValue recomputed, so it stays valid)."""
    page = synthetic_page(index, seed=seed, model=model, source=source)
    acts = page["activations"][:n_activations]
    for a in acts:
        at = a["maxValueTokenIndex"]
        lo = max(0, min(at - n_tokens // 2, len(a["values"]) - n_tokens))
        a["tokens"] = a["tokens"][lo:lo + n_tokens]
        a["values"] = a["values"][lo:lo + n_tokens]
        a["maxValue"] = max(a["values"])
        a["maxValueTokenIndex"] = a["values"].index(a["maxValue"])
        a["minValue"] = min(a["values"])
    page["activations"] = acts
    return page


def small_pages(indices: Iterable[int], **kw: Any) -> list[dict]:
    return [small_page(i, **kw) for i in indices]


def feature_path(index: int, model: str = MODEL, source: str = SOURCE) -> str:
    return f"/api/feature/{quote(model, safe='')}/{quote(source, safe='')}/{index}"


def random_faults(paths: Sequence[str], fraction: float, *, seed: int = 0,
                  kinds: Sequence[str] = RANDOM_FAULT_KINDS, max_in_a_row: int = 2) -> dict[str, list[str]]:
    """About ``fraction`` of ``paths``, each given 1..``max_in_a_row`` random faults."""
    rng = random.Random(seed)
    chosen = rng.sample(list(paths), round(len(paths) * fraction))
    return {p: [rng.choice(kinds) for _ in range(rng.randint(1, max_in_a_row))] for p in chosen}


# --- the bucket -----------------------------------------------------------------------------


def _gz(rows: list[dict]) -> bytes:
    return gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in rows), mtime=0)


def build_bucket(pages: Iterable[dict], *, producer: str = "a", batch_features: int = 1024) -> dict[str, bytes]:
    """The export files for ``pages``, as ``{key: bytes}``, laid out as Neuronpedia's export
    script lays them out (shared/docs/neuronpedia-formats.md, "Batch numbering differs by table"):

    - ``features/batch-N``: ``batch_features`` feature rows each, in the order of ``index`` as
      text (the column is a string), so batch 0 holds "0", "1", "10", "100", ...;
    - ``explanations/batch-N``: likewise ``batch_features`` explanation rows each, by ``index``
      as text (sparse: only features that have explanations);
    - ``activations/batch-N``: the activations of features ``N*batch_features`` to
      ``N*batch_features + batch_features - 1`` (numeric ranges).
    """
    if producer not in ("a", "b"):
        raise ValueError("producer is 'a' (minimal columns) or 'b' (extra columns)")
    objects: dict[str, bytes] = {}
    by_source: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for page in pages:
        model, source = page["modelId"], page["layer"]
        prefix = f"v1/{model}/{source}/"
        for name, rel in (("model.jsonl", "model"), ("source.jsonl", "source"), ("sourceset.jsonl", "sourceSet")):
            if isinstance(page.get(rel), dict):
                objects.setdefault(prefix + name, orjson.dumps(page[rel]) + b"\n")
        by_source[(model, source)].append(page)
    for (model, source), group in sorted(by_source.items()):
        prefix = f"v1/{model}/{source}/"
        as_text = sorted(group, key=lambda p: str(p["index"]))  # ORDER BY index, a text column
        features = [{k: v for k, v in page.items() if k not in _RELATIONS} for page in as_text]
        explanations = [_explanation_row(e, page, producer) for page in as_text for e in page.get("explanations") or ()]
        activations: dict[int, list[dict]] = defaultdict(list)
        for page in sorted(group, key=lambda p: int(p["index"])):
            for a in page.get("activations") or ():
                row = ({k: a[k] for k in ACTIVATION_COLUMNS_A if k in a} if producer == "a"
                       else dict(a, zValues=[], producer_note="b"))
                activations[int(page["index"]) // batch_features].append(row)
        for table, rows in (("features", features), ("explanations", explanations)):
            for n, start in enumerate(range(0, len(rows), batch_features)):
                objects[f"{prefix}{table}/batch-{n}.jsonl.gz"] = _gz(rows[start:start + batch_features])
        for n, rows in sorted(activations.items()):
            objects[f"{prefix}activations/batch-{n}.jsonl.gz"] = _gz(rows)
    return objects


def _explanation_row(e: dict, page: dict, producer: str) -> dict:
    row = {"id": e["id"], "modelId": page["modelId"], "layer": page["layer"], "index": page["index"],
           "authorId": e.get("authorId"), "description": e.get("description"),
           "embedding": None, "typeName": e.get("typeName"),
           "explanationModelName": e.get("explanationModelName"),
           "umap_x": None, "umap_y": None, "umap_cluster": None, "umap_log_feature_sparsity": None}
    if producer == "b":
        row |= {k: v for k, v in e.items() if k not in ("scores",) and k not in row}
    return row


# --- the server -----------------------------------------------------------------------------


@dataclass
class Seen:
    """One request the server received, and how it answered."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    at: float
    answer: str = ""


@dataclass
class FakeNeuronpedia:
    pages: Iterable[dict] = ()
    faults: Mapping[str, Sequence[str]] | None = None
    always: Mapping[str, str] | None = None
    producer: str = "a"
    batch_features: int = 1024
    max_keys: int = 1000
    retry_after: str = "1"
    slow_seconds: float = 2.0
    trickle_seconds: float = 30.0
    """How long a ``trickle`` answer takes to send its whole body."""
    latency: float = 0.0
    """Added to every API answer (to give a test time to interrupt a fetch)."""
    limit_remaining: int | None = None
    """When set, API answers carry ``x-limit-remaining`` counting down from this."""
    api_key: str | None = None
    """When set, the API answers 401 unless ``x-api-key`` carries it."""
    bucket: str = "neuronpedia-datasets"
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[Seen] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.pages = list(self.pages)
        self._by_key = {(p["modelId"], p["layer"], int(p["index"])): p for p in self.pages}
        self.objects = build_bucket(self.pages, producer=self.producer, batch_features=self.batch_features)
        self._faults = {k: deque(v) for k, v in (self.faults or {}).items()}
        self._always = dict(self.always or {})
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ----------------------------------------------------------------------------

    def start(self) -> FakeNeuronpedia:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer((self.host, self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-neuronpedia", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeNeuronpedia:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def exports_url(self) -> str:
        return f"{self.base_url}/{self.bucket}"

    def object_path(self, key: str) -> str:
        return f"/{self.bucket}/{key}"

    # what it saw ------------------------------------------------------------------------

    def seen(self, path: str | None = None, *, prefix: str | None = None, method: str | None = None) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests
                    if (path is None or r.path == path) and (prefix is None or r.path.startswith(prefix))
                    and (method is None or r.method == method)]

    def count(self, path: str | None = None, *, prefix: str | None = None) -> int:
        return len(self.seen(path, prefix=prefix))

    def set_faults(self, faults: Mapping[str, Sequence[str]] | None = None,
                   always: Mapping[str, str] | None = None) -> None:
        with self._lock:
            self._faults = {k: deque(v) for k, v in (faults or {}).items()}
            self._always = dict(always or {})

    def _record(self, seen: Seen, fault_key: str) -> str | None:
        with self._lock:
            self.requests.append(seen)
            if fault_key in self._always:
                return self._always[fault_key]
            q = self._faults.get(fault_key)
            return q.popleft() if q else None

    def _next_remaining(self) -> int | None:
        with self._lock:
            if self.limit_remaining is None:
                return None
            self.limit_remaining = max(0, self.limit_remaining - 1)
            return self.limit_remaining


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the client's connection pool is exercised
    fake: FakeNeuronpedia

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # plumbing -----------------------------------------------------------------------------

    def _seen(self) -> tuple[Seen, str]:
        parts = urlsplit(self.path)
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        seen = Seen(self.command, unquote(parts.path), parse_qs(parts.query),
                    {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic())
        return seen, seen.path

    def _send(self, status: int, body: bytes, content_type: str, fault: str | None,
              seen: Seen, extra: dict[str, str] | None = None) -> None:
        fake = self.fake
        headers = {"Content-Type": content_type, **(extra or {})}
        if fault in ("429", "500", "503", "404", "echo_key_500"):
            status = {"429": 429, "500": 500, "503": 503, "404": 404, "echo_key_500": 500}[fault]
            if fault == "429":
                headers["Retry-After"] = fake.retry_after
                body = orjson.dumps({"error": "Too many requests", "limitPerWindow": 25000,
                                     "remainingRequests": 0})
            elif fault == "echo_key_500":
                body = orjson.dumps({"error": f"internal error for key {seen.headers.get('x-api-key')}"})
            else:
                body = orjson.dumps({"error": f"fault {fault}"})
            headers["Content-Type"] = "application/json"
        seen.answer = fault or str(status)
        if fault == "reset":
            self._hang_up()
            return
        if fault == "slow":
            time.sleep(fake.slow_seconds)
        announced = len(body)
        if fault == "truncate":
            body = body[: len(body) // 2]
            announced = len(body)
        if fault == "corrupt" and len(body) >= 8:
            body = body[:-8] + bytes([body[-8] ^ 0xFF]) + body[-7:]
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(announced))
            self.end_headers()
            if fault == "drop":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self._hang_up()
                return
            if fault == "trickle":  # the body a little at a time, over ~trickle_seconds
                step = max(1, len(body) // 50)
                for i in range(0, len(body), step):
                    self.wfile.write(body[i:i + step])
                    self.wfile.flush()
                    time.sleep(fake.trickle_seconds / 50)
                return
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _json(self, status: int, obj: Any, fault: str | None, seen: Seen) -> None:
        fake = self.fake
        extra = {}
        remaining = fake._next_remaining()
        if remaining is not None:
            extra["x-limit-remaining"] = str(remaining)
        if fake.latency:
            time.sleep(fake.latency)
        self._send(status, orjson.dumps(obj), "application/json; charset=utf-8", fault, seen, extra)

    # routes -------------------------------------------------------------------------------

    def do_GET(self) -> None:
        fake = self.fake
        seen, path = self._seen()
        bucket = f"/{fake.bucket}"
        if path.startswith("/api/feature/"):
            fault = fake._record(seen, path)
            if fake.api_key and seen.headers.get("x-api-key") != fake.api_key:
                return self._json(401, {"error": "Invalid API key"}, fault, seen)
            parts = path[len("/api/feature/"):].split("/")
            page = None
            if len(parts) == 3 and parts[2].isdigit():
                page = fake._by_key.get((parts[0], parts[1], int(parts[2])))
            if page is None:
                return self._json(404, {"error": "Feature not found"}, fault, seen)
            return self._json(200, page, fault, seen)
        if path in (bucket, bucket + "/") and "list-type" in seen.query:
            fault = fake._record(seen, bucket + "/")
            return self._send(200, self._listing(seen.query), "application/xml", fault, seen)
        if path.startswith(bucket + "/"):
            fault = fake._record(seen, path)
            key = path[len(bucket) + 1:]
            data = fake.objects.get(key)
            if data is None:
                body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code>'
                        b"<Message>The specified key does not exist.</Message></Error>")
                return self._send(404, body, "application/xml", fault, seen)
            ctype = "application/gzip" if key.endswith(".gz") else "application/jsonl"
            return self._send(200, data, ctype, fault, seen)
        fake._record(seen, path)
        self._send(404, b'{"error":"no such route"}', "application/json", None, seen)

    def do_POST(self) -> None:
        fake = self.fake
        seen, path = self._seen()
        if path != "/api/features-offset":
            fake._record(seen, path)
            return self._send(404, b'{"error":"no such route"}', "application/json", None, seen)
        try:
            req = orjson.loads(seen.body)
            offset = int(req.get("offset") or 0)
            model, layer = req["modelId"], req["layer"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            fake._record(seen, path)
            return self._json(400, {"error": "modelId, layer and offset are required"}, None, seen)
        fault = fake._record(seen, f"{path}@{offset}")
        if fake.api_key and seen.headers.get("x-api-key") != fake.api_key:
            return self._json(401, {"error": "Invalid API key"}, fault, seen)
        active = sorted((p for (m, s, _), p in fake._by_key.items()
                         if m == model and s == layer and (p.get("maxActApprox") or 0) > 0),
                        key=lambda p: int(p["index"]))
        # Like the site: each page with its source set, activations and explanations.
        out = [{k: v for k, v in p.items() if k not in ("model", "source")}
               for p in active[offset:offset + PAGE_SIZE]]
        return self._json(200, out, fault, seen)

    def _listing(self, query: dict[str, list[str]]) -> bytes:
        fake = self.fake
        prefix = query.get("prefix", [""])[0]
        max_keys = min(int(query.get("max-keys", ["1000"])[0]), fake.max_keys)
        token = query.get("continuation-token", [None])[0]
        after = base64.urlsafe_b64decode(token.encode()).decode() if token else ""
        keys = sorted(k for k in fake.objects if k.startswith(prefix) and k > after)
        page, more = keys[:max_keys], len(keys) > max_keys
        parts = ['<?xml version="1.0" encoding="UTF-8"?>',
                 '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
                 f"<Name>{escape(fake.bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
                 f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
                 f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>"]
        if token:
            parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
        for k in page:
            data = fake.objects[k]
            parts.append(f"<Contents><Key>{escape(k)}</Key><LastModified>2025-09-11T08:50:59.000Z</LastModified>"
                         f"<ETag>&quot;{hashlib.md5(data).hexdigest()}&quot;</ETag><Size>{len(data)}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
        if more:
            nxt = base64.urlsafe_b64encode(page[-1].encode()).decode()
            parts.append(f"<NextContinuationToken>{nxt}</NextContinuationToken>")
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description="Run the fake Neuronpedia (feature API + export bucket).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--n-features", type=int, default=200)
    ap.add_argument("--fault-rate", type=float, default=0.0, help="share of feature URLs given random faults")
    ap.add_argument("--producer", choices=("a", "b"), default="a")
    ap.add_argument("--batch-features", type=int, default=64, help="features per export batch")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    pages = small_pages(range(a.n_features), seed=a.seed)
    faults = random_faults([feature_path(i) for i in range(a.n_features)], a.fault_rate, seed=a.seed)
    fake = FakeNeuronpedia(pages=pages, faults=faults, producer=a.producer, batch_features=a.batch_features,
                           host=a.host, port=a.port).start()
    print(f"fake Neuronpedia: {len(pages)} features of {MODEL}/{SOURCE}, {len(faults)} with faults")
    print(f"  --base-url    {fake.base_url}")
    print(f"  --exports-url {fake.exports_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()
