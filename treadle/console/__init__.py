"""The debug console (`treadle console`): a read-only web page over the replay, reward, state and dead-letter tables.

It reads through the same SQL service as `treadle sql` (no second writer, no store of its own), draws charts as
server-side SVG, and ships every asset in the package, so it works offline.
"""
