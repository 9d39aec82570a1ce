"""Canary decisions: pure statistics and policy (no I/O), plus the promotion/rollback service.

:mod:`controlplane.canary.statistics` owns the arithmetic (running sums, always-valid confidence
sequences, Holm, sample-ratio mismatch); :mod:`controlplane.canary.policy` the rules built on it
(promote / reject / inconclusive / continue, guardrails, post-promotion rollback). The service
module stores their inputs and results on database rows.
"""
