"""What a call is and what is kept: signatures and trees, buckets and the grid, the records, the
plans, the engine, the watch over the module, state across a capture, reasons to run eagerly,
comparisons with eager and the stats."""
