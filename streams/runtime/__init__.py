"""The worker: the Faust app, its intake of fetched batches, table writes, the processor protocol and plugin
registry, metrics and the process plumbing the worker and the sink share."""
