"""The audit log: who changed what, with the state before and after."""
