"""Safety: PII, leaked secrets and destructive commands, as evaluation metrics and as a reward source."""
