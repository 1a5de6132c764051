"""`featurehouse status` checks its options: a bad one is a usage error, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from bench.generate import synthetic_page
from pipeline.config import Settings
from tests.conftest import run_ingest, write

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def test_status_refuses_a_negative_limit(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh")
    summary = run_ingest([write(tmp_path / "in" / "p.json", orjson.dumps(synthetic_page(1)))], settings)
    assert summary.status == "succeeded", summary
    proc = fh("status", "-n", "-1", "--warehouse", str(settings.warehouse))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
