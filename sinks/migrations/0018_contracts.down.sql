DROP VIEW IF EXISTS {database}.step_evidence_latest;
DROP TABLE IF EXISTS {database}.step_evidence;
DROP VIEW IF EXISTS {database}.contract_checks_latest;
DROP TABLE IF EXISTS {database}.contract_checks;
