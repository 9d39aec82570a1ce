"""Does speculation pay? A standing sequential test of the live arm against the no-speculation
share of every deployment's traffic, and what the service does when it does not pay."""
