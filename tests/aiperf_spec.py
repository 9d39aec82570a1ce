"""What AIPerf's own reader requires of our benchmark files, written from its source (never from our
constants, so the tests check our writer against upstream, not against itself)."""

from __future__ import annotations

# AIPerf's reader models (ai-dynamo/aiperf): MetricRecordInfo / MetricRecordMetadata in
# src/aiperf/common/models/record_models.py (required: metadata.session_num, request_start_ns,
# request_end_ns, worker_id, record_processor_id, benchmark_phase; metrics as {"value", "unit"};
# error), and JsonExportData / JsonMetricResult in src/aiperf/common/models/export_models.py (the
# summary: schema_version, per-metric {"unit", "avg", "p50", ...}, was_cancelled, error_summary,
# start_time, end_time). File names: docs/tutorials/working-with-profile-exports.md.
AIPERF_METADATA_REQUIRED = {
    "session_num",
    "request_start_ns",
    "request_end_ns",
    "worker_id",
    "record_processor_id",
    "benchmark_phase",
}
AIPERF_METRIC_STATS = {
    "unit",
    "avg",
    "p1",
    "p5",
    "p10",
    "p25",
    "p50",
    "p75",
    "p90",
    "p95",
    "p99",
    "min",
    "max",
    "std",
}
AIPERF_SUMMARY_TOP = {
    "schema_version",
    "benchmark_id",
    "was_cancelled",
    "error_summary",
    "start_time",
    "end_time",
}
