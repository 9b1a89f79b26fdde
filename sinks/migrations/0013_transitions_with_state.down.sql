DROP VIEW IF EXISTS {database}.transitions_with_state;
