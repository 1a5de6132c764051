-- 0002: who runs a run, so that a run whose process was killed can be told from one still going.
-- host is socket.gethostname() and pid os.getpid() of the process that started (or last retried)
-- the run; with runs.started_at they identify that process. A later ingest on the same host marks
-- a 'running' run whose process is gone as 'abandoned' (pipeline/runstate.py); status and the
-- report show it so on read. Runs recorded before this migration have neither (NULL): left as they are.
-- runs.status is now: running | succeeded | failed | abandoned.

ALTER TABLE runs ADD COLUMN host VARCHAR;
ALTER TABLE runs ADD COLUMN pid INTEGER;
