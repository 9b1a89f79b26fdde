DROP VIEW IF EXISTS {database}.dead_letters_latest;
DROP TABLE IF EXISTS {database}.dead_letters;
