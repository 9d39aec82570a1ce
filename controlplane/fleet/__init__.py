"""The serving fleet as the control plane sees it: backend pools (``backends``), how decisions
reach the fleet (``actuators``, with the payloads and signatures of ``payloads``) and whether the
candidate pool is ready for a canary's traffic (``readiness``)."""
