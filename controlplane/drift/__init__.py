"""Hit-rate drift detection: pure detectors (no I/O) with river's interface and JSON-able state.

``update(x) -> self``, ``drift_detected``, ``reset()``; ``to_state() -> dict`` and
``from_state(dict)`` persist a detector between monitor runs; ``evidence()`` (``attribution()``
for the mix monitor) gives what an alarm event records. The DB-backed monitor, the Celery task
and the API live elsewhere and build on these.
"""

from controlplane.drift.evidence import DriftEvidence
from controlplane.drift.mix_monitor import MixAttribution, MixMonitor
from controlplane.drift.mixture_sr import MixtureSR, SRKernel
from controlplane.drift.observation import RequestObservation
from controlplane.drift.oracle_cusum import OracleCUSUM

__all__ = [
    "DriftEvidence",
    "MixAttribution",
    "MixMonitor",
    "MixtureSR",
    "OracleCUSUM",
    "RequestObservation",
    "SRKernel",
]
