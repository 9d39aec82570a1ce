"""Jobs: realignment and shadow-replay runs, their state table, progress and cancellation, the
recovery of realign attempts (retries with backoff, leases, the sweep), and what a realign job
trains on and registers."""
