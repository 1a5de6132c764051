"""A synthetic source shaped like a real Neuronpedia export, for finding features.

One source of ``n_features`` features (262,144 like ``gemma-3-12b-it/24-gemmascope-2-res-262k``):

* ``explanations/batch-N.jsonl.gz``: one explanation per feature, in the auto-interp producer's
  columns (``id, modelId, layer, index, description, authorId, embedding, triggeredById,
  typeName, explanationModelName, notes, createdAt``). The embedding is 256 floats rounded to 9
  decimals, near its topic's direction (so neighbours share a topic); half the explainer models
  write it as a JSON list, the other half as a JSON string holding the list, as real exports do.
* ``activations/batch-N.jsonl.gz``: excerpts for ``n_active`` of the features (the export
  script's columns): ``excerpts`` per feature of ``tokens`` tokens, a few active.
* ``features/batch-N.jsonl.gz``: the feature rows of those, with ``pos_str`` (top logits).

Deterministic for a seed. ``python -m bench.find_source --out bench/out/find-source``.
"""

from __future__ import annotations

import argparse
import gzip
import random
from pathlib import Path

import orjson

MODEL = "gemma-3-12b-it"
SOURCE = "24-gemmascope-2-res-262k"
DIM = 256

TOPICS = [
    ("jokes and humour", ["joke", "funny", "laugh", "pun", "comedian", "humor"]),
    ("the city of Paris", ["Paris", "France", "French", "Seine", "Louvre", "Eiffel"]),
    ("Python programming language syntax", ["def", "import", "self", "return", "lambda", "class"]),
    ("legal contracts and clauses", ["clause", "party", "agreement", "hereby", "liability", "court"]),
    ("numbers in dates", ["2019", "March", "1st", "year", "century", "date"]),
    ("cooking and recipes", ["recipe", "bake", "oven", "flour", "sugar", "cook"]),
    ("emotional distress and sadness", ["sad", "cry", "grief", "lonely", "tears", "loss"]),
    ("chemical elements", ["oxygen", "carbon", "sodium", "atom", "molecule", "ion"]),
    ("football matches", ["goal", "match", "league", "striker", "referee", "penalty"]),
    ("closing HTML tags", ["</", "div", "span", ">", "tag", "html"]),
    ("questions about the weather", ["rain", "sunny", "forecast", "storm", "cloud", "wind"]),
    ("Chinese characters in technical text", ["机", "做", "数据", "系统", "计算", "模型"]),
    ("CPU and memory hardware", ["CPU", "memory", "cache", "core", "GPU", "RAM"]),
    ("quotation marks around speech", ["\"", "said", "asked", "replied", "'", "told"]),
    ("negation words", ["not", "never", "no", "nothing", "none", "neither"]),
    ("medical symptoms", ["fever", "pain", "cough", "symptom", "doctor", "patient"]),
]
FILLER = ["the", "a", "of", "to", "in", "and", "is", "that", "for", "it", "as", "with", "on", "was", "by",
          "this", "be", "at", "from", "or", "an", "are", "text", "words", "when", "about", "tokens"]
LIST_EXPLAINERS = ["gpt-4o-mini", "claude-4-5-haiku"]  # write the embedding as a JSON list
STRING_EXPLAINERS = ["gemini-2.0-flash", "gpt-4.1-nano"]  # ... as a JSON string holding the list


def _ident(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(25))


def _directions(seed: int) -> list[list[float]]:
    rng = random.Random(f"{seed}:directions")
    return [[rng.gauss(0, 1) for _ in range(DIM)] for _ in TOPICS]


def topic_of(index: int) -> int:
    return (index * 7919) % len(TOPICS)


def write_source(out: Path, n_features: int = 262_144, n_active: int = 16_384, *, seed: int = 0,
                 batch: int = 16_384, excerpts: int = 8, tokens: int = 64, model: str = MODEL,
                 source: str = SOURCE, data_sources: tuple = (None,), activation_batch: int = 1024) -> dict:
    """Write the source's export files under ``out``; returns counts.

    ``data_sources``: the excerpts of a feature take these in turn (``("Chat", "Non-Chat")``:
    a feature with two excerpts has one of each, as the chat models' sources do);
    ``activation_batch``: features per activations (and features) batch file."""
    import numpy as np

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    dirs = np.array(_directions(seed))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    for sub in ("explanations", "activations", "features"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    n_string = 0
    for b, start in enumerate(range(0, n_features, batch)):
        with gzip.open(out / "explanations" / f"batch-{b}.jsonl.gz", "wb", compresslevel=1) as f:
            idx = np.arange(start, min(start + batch, n_features))
            topics = (idx * 7919) % len(TOPICS)
            emb = dirs[topics] * 0.8 + nrng.normal(0, 1 / np.sqrt(DIM), (len(idx), DIM)) * 0.6
            emb /= np.linalg.norm(emb, axis=1, keepdims=True)
            emb = np.round(emb, 9)
            for i, t, e in zip(idx.tolist(), topics.tolist(), emb):
                name, words = TOPICS[t]
                desc = f"{name}: " + " ".join(rng.choice(words + FILLER) for _ in range(rng.randint(2, 7)))
                explainer = rng.choice(LIST_EXPLAINERS + STRING_EXPLAINERS)
                values = e.tolist()
                if explainer in STRING_EXPLAINERS:
                    n_string += 1
                    embedding: object = orjson.dumps(values).decode()
                else:
                    embedding = values
                row = {"id": _ident(rng), "modelId": model, "layer": source, "index": str(i),
                       "description": desc, "authorId": "auto-interp", "embedding": embedding,
                       "triggeredById": "bench", "typeName": "oai_token-act-pair",
                       "explanationModelName": explainer, "notes": None,
                       "createdAt": "2026-02-18T17:18:05.554834"}
                f.write(orjson.dumps(row) + b"\n")
    n_excerpts = 0
    active = sorted(random.Random(f"{seed}:active").sample(range(n_features), n_active))
    vocab = [w for _, ws in TOPICS for w in ws] + FILLER
    for b, start in enumerate(range(0, len(active), activation_batch)):
        part = active[start:start + activation_batch]
        with gzip.open(out / "activations" / f"batch-{b}.jsonl.gz", "wb", compresslevel=1) as fa, \
                gzip.open(out / "features" / f"batch-{b}.jsonl.gz", "wb", compresslevel=1) as ff:
            for i in part:
                _, words = TOPICS[topic_of(i)]
                top = 0.0
                for k in range(excerpts):
                    toks = [rng.choice(FILLER) if rng.random() < 0.5 else " " + rng.choice(vocab) for _ in range(tokens)]
                    vals = [0] * tokens
                    for p in rng.sample(range(tokens), 4):
                        toks[p] = rng.choice(["", " "]) + rng.choice(words)
                        vals[p] = rng.randint(1, 1600) / 8
                    mx = max(vals)
                    top = max(top, mx)
                    fa.write(orjson.dumps({
                        "id": _ident(rng), "modelId": model, "layer": source, "index": str(i),
                        "creatorId": "export", "dataSource": data_sources[k % len(data_sources)], "tokens": toks, "maxValue": mx,
                        "minValue": 0, "values": vals, "maxValueTokenIndex": vals.index(mx),
                        "dfaValues": [], "dfaMaxValue": None, "dfaTargetIndex": None,
                        "binContains": -1, "binMin": -1, "binMax": None}) + b"\n")
                    n_excerpts += 1
                ff.write(orjson.dumps({
                    "modelId": model, "layer": source, "index": str(i), "sourceSetName": "gemmascope-2-res-262k",
                    "maxActApprox": top, "frac_nonzero": 0.001, "pos_str": [" " + w for w in words[:5]],
                    "pos_values": [1.5, 1.25, 1.0, 0.75, 0.5], "neg_str": ["x"], "neg_values": [-1.0],
                    "hookName": "blocks.24.hook_resid_post", "hasVector": False}) + b"\n")
    return {"features": n_features, "explanations": n_features, "string_embeddings": n_string,
            "active_features": n_active, "excerpts": n_excerpts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/find-source"))
    ap.add_argument("--features", type=int, default=262_144)
    ap.add_argument("--active", type=int, default=16_384)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write_source(a.out, a.features, a.active, seed=a.seed))


if __name__ == "__main__":
    main()
