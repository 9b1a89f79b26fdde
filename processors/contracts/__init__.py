"""Action contracts: preconditions on the state graph, postconditions on results, and provenance of each step."""
