"""treadle's benchmark: `python -m bench.run` (or `make bench`); see bench/run.py."""
