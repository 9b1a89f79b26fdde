"""Processors by concern: each folder holds its pure core (no Faust, no Kafka client, no database) and the
plugin that runs it in the worker."""
