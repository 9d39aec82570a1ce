"""Read side of acceptance: time series computed from per-minute rollups."""
