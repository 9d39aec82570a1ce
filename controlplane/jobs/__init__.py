"""Jobs: realignment (and later canary) runs, their state machine, progress and cancellation."""
