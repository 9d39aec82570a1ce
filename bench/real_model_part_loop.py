"""The loop's figures on SmolLM2-135M-Instruct, gathered for ``bench/real_model.py`` (part ``loop``).

Nothing is run here: the loop takes far longer than the other parts, so this part reads what its
two runs left behind and names the figures.

- Offline (``bench/real_model_loop_offline.py``, bench/results/real_model_loop_offline.json): the
  day-0 first drafter trained by the realign task's own code on the target's greedy answers to
  general chat, then realigned on structured work (JSON extraction, tool calls, SQL) with the chat
  traces as the older window; every figure on held-out prompts of documents no training prompt
  used, greedy, k = 4, replayed exactly from teacher forcing (``replay_greedy_rounds``); speed-ups
  are implied by those rounds and the step costs timed in the same run (tokens per verify step over
  a verify pass plus k drafter steps).
- The whole loop (``python -m workers.demo --scenario scenarios/smollm2.toml --summary
  bench/results/real_model_loop_demo.json``): its summary, and the day-0 figures read back from its
  database (``bench.drafters_day0.day0_figures``): ``day0_first_promotion_s`` and
  ``day0_speedup_vs_nospec`` (the live arm's decode throughput on the promoted drafter over before
  the first canary). None where the run did not promote.

Each figure says where it came from in ``detail.sources``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "bench" / "results" / "real_model_loop_offline.json"
DEMO_SUMMARY = ROOT / "bench" / "results" / "real_model_loop_demo.json"
DEMO_DATABASE = ROOT / "var" / "demo" / "controlplane.db"
DEPLOYMENT = "smollm2"


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def measure(bench: Any) -> dict[str, Any]:
    """The loop's figures from the offline bench's results and the demo's summary and database."""
    offline, summary = _read(OFFLINE), _read(DEMO_SUMMARY)
    day0: dict[str, Any] = {}
    if DEMO_DATABASE.is_file() and summary:
        from bench.drafters_day0 import day0_figures

        day0 = day0_figures(f"sqlite:///{DEMO_DATABASE}", DEPLOYMENT)
    first = offline.get("day0", {})
    shift = offline.get("realign", {})
    realigned_by_k = shift.get("implied_speedup_by_k", {})
    out = {
        "day0_speedup_vs_nospec": day0.get("day0_speedup_vs_nospec"),
        "day0_first_promotion_s": day0.get("day0_first_promotion_s"),
        "day0_offline_chat_hit_rate": (first.get("chat_heldout") or {}).get("all", {}).get("hit_rate"),
        "day0_offline_implied_speedup_vs_nospec": first.get("implied_speedup_vs_nospec"),
        "stale_hit_rate": shift.get("stale_hit_rate"),
        "realigned_hit_rate": shift.get("realigned_hit_rate"),
        "realigned_speedup_vs_nospec": shift.get("implied_speedup_vs_nospec"),
        "realigned_best_k_speedup_vs_nospec": max(realigned_by_k.values()) if realigned_by_k else None,
        "old_traffic_drop_points": shift.get("old_traffic_drop_points"),
        "shift_to_promotion_s": summary.get("shift_to_promotion_s"),
        "realign_tokens_per_s": shift.get("realign_tokens_per_s"),
        "demo_decision": summary.get("decision"),
    }
    sources = {
        "day0_speedup_vs_nospec": "demo database (live arm, promoted drafter over before the canary)",
        "day0_first_promotion_s": "demo database (first request to the promotion)",
        "stale_hit_rate": "offline, structured held out, day-0 drafter",
        "realigned_hit_rate": "offline, structured held out, realigned drafter",
        "realigned_speedup_vs_nospec": "offline, implied by replayed rounds and timed step costs",
        "old_traffic_drop_points": "offline, chat held out: day-0 minus realigned hit rate, points",
        "shift_to_promotion_s": "demo summary",
        "realign_tokens_per_s": "offline realignment: completion tokens trained per second",
    }
    detail = {
        "sources": sources,
        "offline_costs": offline.get("costs"),
        "offline_day0_by_k": first.get("implied_speedup_by_k"),
        "offline_realigned_by_k": realigned_by_k,
        "demo_day0": day0,
    }
    return {**out, "detail": detail}
