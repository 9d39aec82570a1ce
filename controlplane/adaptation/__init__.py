"""Adaptation besides drift: a deployment's adaptation policy (``policy``: validation, the GPU
budget arithmetic and the trigger rules, pure) and the service that requests a first drafter for a
deployment without one, or a continuous realignment, from the periodic monitor pass (``service``)."""
