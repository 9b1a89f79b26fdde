"""Step assembly and reward weaving: a step's dispatch, tool results and rewards become its rows."""
