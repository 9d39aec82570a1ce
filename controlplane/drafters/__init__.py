"""Drafter versions: their state machine, the service that owns every write to them, and the
serving config that tells the fleet which drafter to run."""
