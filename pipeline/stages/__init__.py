"""The ingest stages, one module each, in the order a run chains them:
receive → land → parse (flight, records) → stage → validate → load → materialise.

A stage reads the lake (``pipeline.lake``) and the settings; it never imports the orchestrator
(``pipeline.ingest``), a source or an output.
"""
