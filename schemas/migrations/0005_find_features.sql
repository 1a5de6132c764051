-- 0005: every field a real record carries, and the by-token table `featurehouse by-token` reads.
--
-- explanations.embedding: Neuronpedia's search vector of the explanation (OpenAI
-- text-embedding-3-large cut to 256 dimensions), as numbers whichever way it was sent (a JSON
-- list, or a JSON string holding one); one that is not 256 finite numbers is quarantined
-- (schemas/expectations/explanations.json). DOUBLE keeps the 9 decimals exports write.
-- explanations.extra / activations.extra: every field of the record without a column of its
-- own (notes, triggeredById, triggeredByUser, umap_*; zValues; any field not known here).
-- Rows loaded before this migration have NULL in all three: load their inputs again
-- (`featurehouse ingest --reprocess`) to fill them.
ALTER TABLE explanations ADD COLUMN embedding DOUBLE[];
ALTER TABLE explanations ADD COLUMN extra JSON;
ALTER TABLE activations ADD COLUMN extra JSON;

-- feature_token_stats: one row per (model_id, source_id, feature_index, data_source, token)
-- for every token on which an excerpt of the feature is active (activation > 0), not only the
-- top 10 of feature_activation_stats. Materialised with the statistics
-- (schemas/sql/feature_token_stats.sql), so it is exact after every load.
CREATE TABLE feature_token_stats (
    model_id                VARCHAR NOT NULL,
    source_id               VARCHAR NOT NULL,
    feature_index           BIGINT NOT NULL,
    data_source             VARCHAR,             -- NULL is its own group
    token                   VARCHAR NOT NULL,
    max_activation          DOUBLE,              -- the highest activation of the feature on it
    n_active                BIGINT,              -- active occurrences of it in the excerpts
    n_peak_excerpts         BIGINT,              -- excerpts whose peak (max_value_token_index) is on it
    refreshed_at            TIMESTAMP
);
