"""The README answers first and the manual in docs/ holds together: every relative link resolves.

Pure Python, no pipeline import: links (``[text](target)``, ``![alt](target)``) outside code,
to files relative to the page, and ``#anchors`` to a heading of the page they name (GitHub's
slug rule).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose_lines(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, in_code = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but hyphens and spaces dropped,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    out = []
    for line in _prose_lines(path):
        out.extend(LINK.findall(CODE_SPAN.sub("", line)))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if not target or EXTERNAL.match(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = page if not file_part else (page.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {_rel(dest)}")
    assert not broken, f"{_rel(page)} has broken links:\n  " + "\n  ".join(broken)


def test_readme_answers_first():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move the detail into docs/"
    assert "make run" in text and "make test" in text


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in links(README) if t and not EXTERNAL.match(t) and not t.startswith("#")}
    assert DOCS, "docs/ holds no page"
    unlinked = [_rel(p) for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


def test_the_slug_rule():
    assert slug("What to fetch: `featurehouse.toml`") == "what-to-fetch-featurehousetoml"
    assert slug("With Docker: `make up`") == "with-docker-make-up"
    assert slug("Two roads in") == "two-roads-in"
    assert slug("What `--batches A:B` selects") == "what---batches-ab-selects"


def test_the_tables_page_excerpt_query_gives_the_peak_in_the_middle(tmp_path):
    """Issue 45: docs/tables.md's "excerpt around the strongest activation" was off by one (the
    index counts from 0, lists from 1) and gave [] for a peak in the first five tokens. Run as
    printed, against a warehouse of the seed page: each context holds the peak token, five
    tokens each side where there are."""
    import re

    from pipeline import Settings
    from tests.conftest import FIXTURES, query, run_ingest

    text = (ROOT / "docs" / "tables.md").read_text()
    sql = re.search(r"(SELECT activation_id, max_value,\s+list_slice.*?LIMIT 3;)", text, re.S).group(1)
    sql = sql.replace("ORDER BY max_value DESC LIMIT 3", "ORDER BY activation_id")
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([FIXTURES], settings)
    got = dict(((a, tuple(c)) for a, _, c in query(settings, sql)))
    for a, tokens, peak in query(settings, "SELECT activation_id, tokens, max_value_token_index FROM activations "
                                           "WHERE feature_index = 45698"):
        want = tuple(tokens[max(peak - 5, 0):peak + 6])
        assert got[a] == want, (a, peak)


def test_every_environment_variable_read_is_in_the_settings_table():
    """Issue 45: FEATUREHOUSE_REPORTS and FEATUREHOUSE_SCHEMAS were read and documented nowhere."""
    import subprocess

    used = set(subprocess.run(
        ["grep", "-rhoE", r"(FEATUREHOUSE|NEURONPEDIA)_[A-Z0-9_]*[A-Z0-9]", "pipeline", "dags", "deploy",
         "docker-compose.yml", "featurehouse.toml"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    used -= {"FEATUREHOUSE_MAX"}  # the prefix every size-limit refusal names
    table = (ROOT / "docs" / "cli.md").read_text().split("## Settings", 1)[1]
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert not missing, missing


def test_config_says_where_each_setting_came_from(tmp_path):
    import json
    import os
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("featurehouse")
    env = dict(os.environ, FEATUREHOUSE_BATCH_BYTES="1000000")
    out = subprocess.run([str(exe), "config", "--warehouse", str(tmp_path / "w"), "--format", "json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = {r["setting"]: r for r in json.loads(out)}
    assert (rows["batch_bytes"]["value"], rows["batch_bytes"]["from"]) == ("1000000", "$FEATUREHOUSE_BATCH_BYTES")
    assert rows["warehouse"]["from"] == "command line" and rows["retention_days"]["from"] == "default"
    assert rows["catalog_url"]["value"] == f"sqlite:{tmp_path / 'w' / 'catalog.sqlite'}"


def test_the_querying_page_python_snippet_runs_offline_as_printed(tmp_path):
    """Issue 45: docs/querying.md's Python snippet failed offline (ATTACH downloaded the ducklake
    extension, which featurehouse had installed from its wheel). Run as printed, from a folder
    holding a `warehouse`, with no network (a new network namespace where one can be made: root,
    as in CI) and the extension folder the one featurehouse installs into."""
    import shutil

    from pipeline import Settings
    from pipeline.lake.extensions import extension_directory
    from tests.conftest import FIXTURES, run_ingest

    text = (ROOT / "docs" / "querying.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "~/.cache/featurehouse/duckdb-extensions" in code
    run_ingest([FIXTURES], Settings(warehouse=tmp_path / "warehouse"))
    folder = extension_directory()
    assert folder is not None and folder.is_dir()
    code = code.replace("~/.cache/featurehouse/duckdb-extensions", str(folder)) + "\nprint(len(df))\n"
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0 and shutil.which("unshare") and subprocess.run(
            ["unshare", "-n", "true"], capture_output=True).returncode == 0:  # a container may forbid it
        cmd = ["unshare", "-n", *cmd]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) > 0
