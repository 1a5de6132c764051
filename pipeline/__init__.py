"""featurehouse: Neuronpedia feature pages into a DuckDB warehouse.

Stages, one module each: receive → land → parse → validate → load → materialise → report.
"""

from .config import Settings
from .ingest import RunSummary, ingest
from .materialise import refresh as refresh_stats
from .parse import Rejected, parse_bytes

__all__ = ["Settings", "RunSummary", "ingest", "refresh_stats", "Rejected", "parse_bytes"]
__version__ = "0.1.0"
