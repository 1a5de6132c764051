-- 0004: which captures each input holds, so that content seen again can be decided without
-- parsing it, and two run counts that make a run's inputs add up.
--
-- input_captures: one row per (input, feature, table) an input holds a capture of, whether it
-- loaded, lost to a newer capture, or was replaced since (a page claims its feature's three
-- tables, an export batch its own table for each feature in it). Written when the input is
-- parsed (again, with --reprocess). When bytes already landed arrive with a newer capture time,
-- the load compares that time with the current capture of each (feature, table) they hold
-- (feature_captures): where they are still the current capture only its time moves forward;
-- where another capture holds it and this one is newer, the input is read again and loads.
-- Inputs landed before this migration have no rows here: they are read again in that case.
CREATE TABLE input_captures (
    input_sha256        VARCHAR NOT NULL,
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,
    feature_index       BIGINT NOT NULL,
    table_name          VARCHAR NOT NULL,        -- features | activations | explanations
    run_id              VARCHAR NOT NULL,        -- the run that parsed the input (last)
    recorded_at         TIMESTAMP NOT NULL
);

-- received = new (n_landed) + read again (n_reread) + skipped (n_duplicates) + not read (n_unread)
ALTER TABLE runs ADD COLUMN n_reread BIGINT;    -- inputs landed before and read again (--reprocess, a
                                                -- size limit since raised, a newer capture of the bytes)
ALTER TABLE runs ADD COLUMN n_unread BIGINT;    -- inputs refused before anything was read (a named pipe,
                                                -- a broken link, a folder that cannot be read); also in n_rejected
