"""Credit assignment: episode-level rewards spread over the episode's steps by a named rule."""
