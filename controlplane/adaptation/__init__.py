"""Adaptation besides drift: the service that requests a first drafter for a deployment without
one, or a continuous realignment, from the periodic monitor pass. Its policy and pure rules are the
leaf module ``controlplane.adaptation_policy`` (the serving weights read it too)."""
