"""Plans as events: the scheduler's pure DAG fold (dag); the processor plugin around it is not built yet."""
