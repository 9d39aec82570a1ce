"""Jobs: realignment and shadow-replay runs, their state table, progress and cancellation, and what
a realign job trains on and registers."""
