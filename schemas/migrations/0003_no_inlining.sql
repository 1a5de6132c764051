-- Every insert writes Parquet; nothing is kept inline in the catalog.
--
-- DuckLake keeps the rows of a small insert inline in the catalog until they are flushed to
-- Parquet (`featurehouse maintain` does). That flush is not snapshot-safe: it deleted the
-- inlined rows under a reader holding a transaction open (its counts dropped: activations
-- 5859 -> 0), and a load running beside it failed with "Failed to read inlined data ... does
-- not exist". Small files from small commits are merged by `featurehouse maintain` instead,
-- which keeps every snapshot's files until they expire.
CALL featurehouse.set_option('data_inlining_row_limit', 0);
