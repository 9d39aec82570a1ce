"""Canaries: the phase table, pure statistics and policy (no I/O), and the services that drive a
canary row through its phases.

:mod:`controlplane.canary.phases` is the phase table; :mod:`controlplane.canary.statistics` owns
the arithmetic (running sums, always-valid confidence sequences, Holm, sample-ratio mismatch);
:mod:`controlplane.canary.policy` the rules built on it (promote / reject / inconclusive /
continue, guardrails, post-promotion rollback) and ``CanaryPolicy``, the one source of canary
defaults. :mod:`controlplane.canary.service` owns canary rows and decisions,
:mod:`controlplane.canary.shadow` the replay job's reads and writes, and
:mod:`controlplane.canary.evaluate` the automation that judges and watches.
"""
