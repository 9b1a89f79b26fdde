DROP VIEW IF EXISTS {database}.raw_events_latest;
DROP TABLE IF EXISTS {database}.raw_events;
