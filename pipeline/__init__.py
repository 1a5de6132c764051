"""featurehouse: Neuronpedia feature pages into a DuckDB warehouse.

Stages, one module each: receive → land → parse → validate → load → materialise → report.
"""

from .config import Settings
from .ingest import RunSummary, ingest
from .stages.materialise import refresh as refresh_stats
from .stages.parse import Rejected, parse_bytes
from .warm import warm_up

__all__ = ["Settings", "RunSummary", "ingest", "refresh_stats", "Rejected", "parse_bytes", "warm_up"]
__version__ = "0.1.0"
