"""Reports for people and machines: `treadle eval` (and its charts), `treadle explain`, `treadle state`."""
