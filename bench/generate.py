"""Synthetic Neuronpedia API-JSON feature pages built from the real seed page.

New keys (feature index, activation and explanation ids), the seed's structure, size and value
shapes: zero activations stay zero and positive ones are scaled by an exact binary factor
(k/8 for k in 4..12, i.e. 0.5 to 1.5), so they stay short decimals like the real ``392.25``
instead of becoming long random floats (which are slow to parse and flatter any comparison
against a bare ``read_json``). By default each page keeps the seed's one activation whose
``tokens`` and ``values`` differ in length, as both real captures we have carry a bad record.
Deterministic for a given seed, so tests and benchmarks can regenerate them.

    python -m bench.generate --n 1000 --out bench/out/pages
"""

from __future__ import annotations

import argparse
import copy
import functools
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import orjson

from pipeline.stages import flight

SEED_PAGE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "000_e9e35889d0228029.txt"


def _iso(v):
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%dT%H:%M:%S.") + f"{v.microsecond // 1000:03d}Z"
    raise TypeError(type(v))


@functools.lru_cache(maxsize=1)
def seed_page() -> dict:
    """The real seed feature page as the API would send it (dates as ISO strings)."""
    rows = flight.parse_rows(SEED_PAGE.read_bytes())
    found, page = flight.find_key(rows, "initialNeuron")
    assert found
    return orjson.loads(orjson.dumps(page, default=_iso))


def _ident(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(24))


#: Exact binary scale factors: k/8 for k in 4..12 (0.5 to 1.5). A bf16-like value times one of
#: these is still a short decimal (392.25 * 1.125 = 441.28125).
SCALES = tuple(k / 8 for k in range(4, 13))


def synthetic_page(index: int, *, seed: int = 0, model: str = "gpt-oss-20b",
                   source: str = "11-resid-post-aa", valid: bool = True) -> dict:
    """One API-JSON page for feature ``index``. With ``valid`` every record passes validation
    (the seed's one bad activation is repaired); otherwise the seed's defect is kept."""
    rng = random.Random(f"{seed}:{model}:{source}:{index}")
    base = seed_page()
    page = copy.deepcopy(base)
    page["modelId"], page["layer"], page["index"] = model, source, str(index)
    scale = rng.choice(SCALES)
    page["maxActApprox"] = base["maxActApprox"] * scale
    page["frac_nonzero"] = min(1.0, base["frac_nonzero"] * rng.uniform(0.1, 10))
    if isinstance(page.get("source"), dict):
        page["source"]["id"], page["source"]["modelId"] = source, model
    data_sources = ["Chat", "Non-Chat", None]
    for a in page["activations"]:
        a["id"] = _ident(rng)
        a["modelId"], a["layer"], a["index"] = model, source, str(index)
        n = min(len(a["tokens"]), len(a["values"])) if valid else len(a["values"])
        if valid:
            a["tokens"] = a["tokens"][:n]
        a["values"] = [v * scale if v else v for v in a["values"][:n]]
        a["maxValue"] = max(a["values"]) if a["values"] else 0
        a["maxValueTokenIndex"] = a["values"].index(a["maxValue"]) if a["values"] else 0
        if rng.random() < 0.1:
            a["dataSource"] = rng.choice(data_sources)
    for e in page["explanations"]:
        e["id"] = _ident(rng)
    return page


def synthetic_pages(n: int, *, start: int = 0, seed: int = 0, **kw) -> Iterator[dict]:
    for i in range(start, start + n):
        yield synthetic_page(i, seed=seed, **kw)


#: The page generators: ``a`` writes compact JSON (orjson) with the seed's excerpt lengths; ``b``
#: writes as Python's ``json.dumps`` does (a space after every ``,`` and ``:``), every value as a
#: float (``0.0``, not ``0``), and excerpts cut or repeated to other lengths (16 to 2x the seed's),
#: so that no one serializer or shape flatters a comparison with DuckDB's read_json.
GENERATORS = ("a", "b")


def _reshape(page: dict, rng: random.Random) -> dict:
    """Generator ``b``'s excerpts: each cut to, or repeated up to, a length of its own; a bad
    record (tokens and values of different lengths) stays bad; values written as floats."""
    for a in page["activations"]:
        toks, vals = a["tokens"], a["values"]
        n = rng.randint(16, 2 * max(len(vals), 16))
        gap = len(toks) - len(vals)  # the seed's bad record keeps its mismatch
        reps = -(-n // max(len(vals), 1))
        vals = [float(v) for v in (vals * reps)[:n]]
        toks = (toks * reps)[:max(n + gap, 1)] if toks else toks
        a["tokens"], a["values"] = toks, vals
        a["maxValue"] = float(max(vals)) if vals else 0.0
        a["minValue"] = float(min(vals)) if vals else 0.0
        a["maxValueTokenIndex"] = vals.index(max(vals)) if vals else 0
    page["maxActApprox"] = float(page["maxActApprox"])
    return page


def write_pages(n: int, out: Path, *, start: int = 0, seed: int = 0, valid: bool = False,
                generator: str = "a") -> list[Path]:
    """Write ``n`` one-line API-JSON pages into ``out``; by default each carries the seed's bad
    record (``valid=False``), as real pages do. ``generator``: see :data:`GENERATORS`."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for page in synthetic_pages(n, start=start, seed=seed, valid=valid):
        p = out / f"{page['modelId']}__{page['layer']}__{page['index']}.json"
        if generator == "b":
            page = _reshape(page, random.Random(f"b:{seed}:{page['index']}"))
            p.write_text(json.dumps(page, ensure_ascii=False), encoding="utf-8")
        else:
            p.write_bytes(orjson.dumps(page))
        paths.append(p)
    return paths


#: The columns Neuronpedia's export-data.py writes for an activation row, in its order.
EXPORT_ACTIVATION_COLUMNS = ("id", "modelId", "layer", "index", "creatorId", "dataSource", "tokens", "maxValue",
                             "minValue", "values", "maxValueTokenIndex", "dfaValues", "dfaMaxValue",
                             "dfaTargetIndex", "binContains", "binMin", "binMax")


def write_activation_export(path: Path, min_expanded_bytes: int, *, start: int = 0, seed: int = 0,
                            model: str = "gpt-oss-20b", source: str = "11-resid-post-aa",
                            compresslevel: int = 1) -> dict:
    """Write a gzip activations export batch (export-data.py columns, one JSON row per line)
    holding the activations of features ``start``, ``start + 1``, ... until it expands to at
    least ``min_expanded_bytes``. Each feature's rows are the seed's, its values scaled by one of
    :data:`SCALES` (zeros stay zero, short decimals stay short), with fresh ids; each feature
    keeps the seed's one bad record (tokens and values of different lengths), as real data does.
    Returns ``{"rows", "features", "expanded_bytes", "gzip_bytes"}``."""
    import gzip

    base = seed_page()
    # One encoded template per scale; a feature's rows are the template with its ids and index.
    templates = []
    for scale in SCALES:
        lines = []
        for a in base["activations"]:
            row = {k: a.get(k) for k in EXPORT_ACTIVATION_COLUMNS}
            row.update(id="@ID@", modelId=model, layer=source, index="@INDEX@", creatorId=row["creatorId"] or "export")
            row["values"] = [v * scale if v else v for v in a["values"]]
            row["maxValue"] = max(row["values"]) if row["values"] else 0
            lines.append(orjson.dumps(row) + b"\n")
        templates.append(lines)
    rng = random.Random(f"{seed}:{model}:{source}:export:{start}")
    rows = expanded = 0
    index = start
    with gzip.open(path, "wb", compresslevel=compresslevel) as out:
        while expanded < min_expanded_bytes:
            key = str(index).encode()
            for line in rng.choice(templates):
                line = line.replace(b'"@ID@"', b'"' + _ident(rng).encode() + b'"', 1)
                line = line.replace(b'"@INDEX@"', b'"' + key + b'"', 1)
                out.write(line)
                rows += 1
                expanded += len(line)
            index += 1
    return {"rows": rows, "features": index - start, "expanded_bytes": expanded, "gzip_bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/pages"))
    ap.add_argument("--valid", action="store_true", help="repair the seed's bad record in every page")
    ap.add_argument("--generator", choices=GENERATORS, default="a")
    a = ap.parse_args()
    paths = write_pages(a.n, a.out, start=a.start, seed=a.seed, valid=a.valid, generator=a.generator)
    print(f"wrote {len(paths)} pages to {a.out}")


if __name__ == "__main__":
    main()
