"""How the pages people read write a token and a number: the run report, the feature card
(``show --html``) and the web app show them alike.

``featurehouse serve`` (``web.py``) imports these too.
"""

from __future__ import annotations

import math
import numbers
from datetime import datetime
from decimal import Decimal
from typing import Any

__all__ = ["visible_token", "rounded", "density"]


def visible_token(token: str | None) -> str:
    """A token as a person can tell it apart: leading and trailing spaces as ␣, newlines as ↵,
    tabs as ⇥ (" CPU" and "CPU" differ). Not escaped for HTML: the caller escapes it."""
    if token is None:
        return ""
    t = token.replace("\n", "↵").replace("\t", "⇥")
    core = t.strip(" ")
    lead, trail = len(t) - len(t.lstrip(" ")), len(t) - len(t.rstrip(" "))
    if not core:
        return "␣" * len(t)
    return "␣" * lead + core + "␣" * trail


def rounded(v: Any, digits: int = 3) -> str:
    """A number for people: whole numbers with thousands separators, others to ``digits``
    significant digits (``3.35e-05``, not ``3.347874052815106e-05``; ``12.3``; ``1,235``);
    None as a dash; a time to the second. What is not a number is written as it is."""
    if v is None:
        return "–"
    if isinstance(v, datetime):  # a time to the second (a capture's microseconds say nothing to a reader)
        return v.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, bool) or not isinstance(v, (numbers.Real, Decimal)):
        return str(v)
    if isinstance(v, numbers.Integral):  # numpy's and DuckDB's integers too
        return f"{int(v):,}"
    v = float(v)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def density(v: Any) -> str:
    """A firing density (a share of all tokens) as a percentage, as Neuronpedia's pages write
    it: ``0.00335%``, not ``3.347874052815106e-05``; None as a dash."""
    if v is None or isinstance(v, bool) or not isinstance(v, (numbers.Real, Decimal)):
        return rounded(v)
    v = float(v)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v == 0:
        return "0%"
    p = v * 100
    if abs(p) >= 1:
        return f"{p:.3g}%"
    # three significant digits, written out (a 262k source's rarest fire on 1e-9 of tokens:
    # "0.000000123%", not "1.23e-07%"); trailing zeros dropped ("0.01%")
    return f"{p:.{2 - math.floor(math.log10(abs(p)))}f}".rstrip("0").rstrip(".") + "%"
