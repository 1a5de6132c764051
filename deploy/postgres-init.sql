-- Run once by the postgres service when its data volume is new (/docker-entrypoint-initdb.d), and
-- by the tests' throwaway PostgreSQL: the warehouse's DuckLake catalog gets a database of its own,
-- apart from Airflow's metadata database.
CREATE DATABASE featurehouse;
