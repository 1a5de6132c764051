"""The lakehouse's plumbing: the DuckLake catalog and its commit lock (warehouse), S3 storage,
the landing area, a run's state in the catalog (runstate), history, maintenance and the
migration from the 0.1 single-file warehouse (legacy).

The lake imports nothing of the pipeline but its settings (``pipeline.config``).
"""
