"""Reward sources that ask an outside judge (an LLM behind HTTP) about a step."""
