"""Canary measurements that need torch: the shadow replay of held-out prompts through each arm."""

from workers.canary.replay import ArmReport, CostProfile, ReplayResult, measure_costs, shadow_replay

__all__ = ["ArmReport", "CostProfile", "ReplayResult", "measure_costs", "shadow_replay"]
