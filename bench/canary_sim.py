"""Canary decision rule on simulated three-arm streams with known true effects (half of bench/canary.py).

Each stream is one live canary: requests are routed to no speculation / incumbent / candidate by
the service's default weights and the rule of :mod:`controlplane.canary.policy` is evaluated after
*every* request (continuous monitoring) until it decides or reaches ``max_requests``. The rule runs
vectorised across streams through :func:`controlplane.canary.policy.decision_codes`, the very
function :func:`~controlplane.canary.policy.decide` wraps (cross-checked on a few streams below).

Request model (overdispersed, as real traffic is): each request draws its own per-token
acceptance ``alpha_r ~ Beta(mean * KAPPA, (1 - mean) * KAPPA)``, runs ``1 + Poisson(MEAN_STEPS)``
verify steps of ``K`` drafted tokens, and its tokens per step is the mean of those steps (the
exact truncated-geometric mean plus a normal draw with the exact per-step variance / steps).
Latency per output token is the step time (``target_step * (verify + K c)`` for speculation,
``target_step`` without) times a per-request log-normal load factor, divided by tokens per step.

Measured:
- **False promotion** under a zero true effect (candidate drawn exactly like the incumbent, so it
  is not better and any promotion is false), for our rule and for a naive fixed-sample test
  (one-sided z on the same relative differences, each condition at alpha, no multiplicity
  correction) looked at every ``NAIVE_LOOK_EVERY`` requests, as dashboards are.
- **Requests to decide** (all arms together) for true tokens-per-step effects of +5, +10 and +20 %:
  median and p90 over streams of the request at which the rule promoted (streams that ended
  otherwise are counted as ``max_requests`` and their share is reported), and for a -10 % harmful
  candidate the requests to reject.

Runnable alone: ``python bench/canary_sim.py [--quick] [--seed N]`` writes
``bench/results/canary_sim.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.canary.policy import (  # noqa: E402
    CONTINUE,
    DECISION_NAMES,
    INCONCLUSIVE,
    PROMOTE,
    REJECT,
    decide,
    decision_codes,
)
from controlplane.canary.statistics import (  # noqa: E402
    LATENCY_MS_PER_TOKEN,
    TOKENS_PER_STEP,
    ArmAccumulator,
    MetricSummary,
    RelativeDifference,
    relative_difference,
)
from controlplane.canary_policy import ARM_BASELINE, ARM_CANDIDATE, ARM_INCUMBENT, ARMS, CanaryPolicy  # noqa: E402

RESULTS = ROOT / "bench" / "results"
K = 4  # drafted tokens per verify step
COST_RATIO = 0.1  # drafter step / target step
VERIFY_COST = 1.1  # verifying K + 1 tokens relative to one
TARGET_STEP_MS = 25.0
INCUMBENT_ACCEPTANCE = 0.7  # mean per-token acceptance of the incumbent drafter
KAPPA = 20.0  # Beta concentration of per-request acceptance (sd ~ 0.1 around 0.7)
MEAN_STEPS = 30
LOAD_SIGMA = 0.2  # per-request log-normal load noise on step time
WEIGHTS = {ARM_BASELINE: 0.1, ARM_INCUMBENT: 0.8, ARM_CANDIDATE: 0.1}  # the service's default split
NAIVE_LOOK_EVERY = 100
EFFECTS = (0.05, 0.10, 0.20)
HARM_EFFECT = -0.10
CHUNK = 100  # streams simulated together
BLOCK = 2_000  # requests simulated at a time (memory: CHUNK x BLOCK floats per array); a multiple of
# NAIVE_LOOK_EVERY so the naive rule's looks stay on every hundredth request


def expected_tokens(alpha: np.ndarray | float) -> np.ndarray:
    """Mean tokens per verify step for per-token acceptance ``alpha``: ``(1 - a^(K+1)) / (1 - a)``."""
    a = np.asarray(alpha, dtype=np.float64)
    return np.asarray(sum(a**j for j in range(K + 1)))


def tokens_variance(alpha: np.ndarray) -> np.ndarray:
    """Variance of one step's tokens (1 + accepted, accepted truncated-geometric at K)."""
    probabilities = [alpha**j * (1 - alpha) for j in range(K)] + [alpha**K]
    mean = sum((j + 1) * p for j, p in enumerate(probabilities))
    second = sum((j + 1) ** 2 * p for j, p in enumerate(probabilities))
    return np.asarray(second - mean * mean)


def acceptance_for_effect(effect: float) -> float:
    """Candidate mean acceptance whose expected tokens per step is ``(1 + effect)`` x the incumbent's."""
    target = (1.0 + effect) * float(expected_tokens(INCUMBENT_ACCEPTANCE))
    low, high = 0.0, 0.999
    for _ in range(80):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if float(expected_tokens(mid)) < target else (low, mid)
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Streams:
    arm: np.ndarray  # (S, N) int: index into ARMS
    tokens_per_step: np.ndarray  # (S, N)
    latency_ms_per_token: np.ndarray  # (S, N)


def simulate(rng: np.random.Generator, streams: int, requests: int, candidate_acceptance: float) -> Streams:
    shape = (streams, requests)
    shares = np.array([WEIGHTS[a] for a in ARMS])
    arm = rng.choice(len(ARMS), size=shape, p=shares / shares.sum())
    mean_acceptance = np.where(arm == ARMS.index(ARM_CANDIDATE), candidate_acceptance, INCUMBENT_ACCEPTANCE)
    alpha = rng.beta(mean_acceptance * KAPPA, (1.0 - mean_acceptance) * KAPPA)
    steps = 1 + rng.poisson(MEAN_STEPS, size=shape)
    noise = rng.standard_normal(shape) * np.sqrt(tokens_variance(alpha) / steps)
    speculative_tps = np.clip(expected_tokens(alpha) + noise, 1.0, K + 1.0)
    load = rng.lognormal(0.0, LOAD_SIGMA, size=shape)
    baseline = arm == ARMS.index(ARM_BASELINE)
    tps = np.where(baseline, 1.0, speculative_tps)
    step_ms = TARGET_STEP_MS * np.where(baseline, 1.0, VERIFY_COST + K * COST_RATIO) * load
    return Streams(arm, tps, step_ms / tps)


class RunningSums:
    """Per arm and metric, sums carried across blocks of requests, so streams can stop early."""

    def __init__(self, streams: int) -> None:
        self.n = {arm: np.zeros(streams) for arm in ARMS}
        self.total: dict[tuple[str, str], np.ndarray] = {}
        self.squares: dict[tuple[str, str], np.ndarray] = {}
        # Sums are of deviations from a fixed centre (the first block's mean): keeps the
        # running variance accurate where raw sums of squares would cancel.
        self.centre: dict[tuple[str, str], float] = {}

    def block(self, s: Streams) -> dict[str, dict[str, MetricSummary]]:
        """Summaries after each request of this block, arrays (S, B); advances the carry."""
        out: dict[str, dict[str, MetricSummary]] = {}
        for index, arm in enumerate(ARMS):
            mask = s.arm == index
            n = self.n[arm][:, None] + np.cumsum(mask, axis=1)
            self.n[arm] = n[:, -1].copy()
            safe_n = np.maximum(n, 1.0)
            out[arm] = {}
            for metric, values in (
                (TOKENS_PER_STEP, s.tokens_per_step),
                (LATENCY_MS_PER_TOKEN, s.latency_ms_per_token),
            ):
                key = (arm, metric)
                if key not in self.centre:
                    self.centre[key] = float(np.mean(values[mask])) if mask.any() else 0.0
                    self.total[key] = np.zeros(n.shape[0])
                    self.squares[key] = np.zeros(n.shape[0])
                x = np.where(mask, values - self.centre[key], 0.0)
                total = self.total[key][:, None] + np.cumsum(x, axis=1)
                squares = self.squares[key][:, None] + np.cumsum(x * x, axis=1)
                self.total[key], self.squares[key] = total[:, -1].copy(), squares[:, -1].copy()
                mean = total / safe_n
                variance = np.where(n >= 2, (squares - total * mean) / np.maximum(n - 1.0, 1.0), np.inf)
                out[arm][metric] = MetricSummary(n, mean + self.centre[key], np.maximum(variance, 0.0))
        return out


def running_summaries(s: Streams) -> dict[str, dict[str, MetricSummary]]:
    """Per arm and metric, the running (n, mean, variance) after each request: arrays (S, N)."""
    return RunningSums(s.arm.shape[0]).block(s)


def first_decision(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per stream: the first non-continue code (CONTINUE if none) and its 0-based index (-1 if none)."""
    decided = codes != CONTINUE
    any_decided = decided.any(axis=1)
    index = np.where(any_decided, decided.argmax(axis=1), -1)
    code = np.where(any_decided, codes[np.arange(codes.shape[0]), np.maximum(index, 0)], CONTINUE)
    return code, index


def _normal_sf(z: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(z / math.sqrt(2.0))


def naive_codes(summaries: dict[str, dict[str, MetricSummary]], policy: CanaryPolicy) -> np.ndarray:
    """The same conditions with fixed-sample one-sided z-tests at alpha each, no correction."""

    def p(diff: RelativeDifference, null: float, greater: bool) -> np.ndarray:
        z = (diff.estimate - null) / diff.se * (1.0 if greater else -1.0)
        return _normal_sf(np.where(np.isfinite(diff.se), z, -np.inf))

    tps = relative_difference(
        summaries[ARM_CANDIDATE][TOKENS_PER_STEP], summaries[ARM_INCUMBENT][TOKENS_PER_STEP]
    )
    lat_inc = relative_difference(
        summaries[ARM_CANDIDATE][LATENCY_MS_PER_TOKEN], summaries[ARM_INCUMBENT][LATENCY_MS_PER_TOKEN]
    )
    lat_base = relative_difference(
        summaries[ARM_CANDIDATE][LATENCY_MS_PER_TOKEN], summaries[ARM_BASELINE][LATENCY_MS_PER_TOKEN]
    )
    a, m = policy.alpha, policy.non_inferiority_margin
    promote = (
        (p(tps, -m, True) <= a)
        & (p(lat_base, 0.0, False) <= a)
        & ((p(tps, 0.0, True) <= a) | (p(lat_inc, 0.0, False) <= a))
    )
    harm = (p(tps, -m, False) <= a) | (p(lat_inc, 0.0, True) <= a) | (p(lat_base, 0.0, True) <= a)
    counts = np.stack([summaries[arm][LATENCY_MS_PER_TOKEN].n for arm in ARMS])
    ready = counts.min(axis=0) >= policy.min_samples_per_arm
    return np.where(ready, np.where(harm, REJECT, np.where(promote, PROMOTE, CONTINUE)), CONTINUE)


def run_cell(
    rng: np.random.Generator, policy: CanaryPolicy, streams: int, effect: float, *, naive: bool
) -> dict[str, np.ndarray]:
    """Decisions of ``streams`` canaries with a true tokens-per-step effect ``effect``.

    Requests are simulated in blocks and a chunk of streams stops once every stream in it has
    decided (under both rules when ``naive``); the rule's limit ends the rest inconclusive.
    """
    candidate_acceptance = acceptance_for_effect(effect)
    rules = ("ours", "naive") if naive else ("ours",)
    out: dict[str, list[np.ndarray]] = {f"{r}_{f}": [] for r in rules for f in ("code", "at")}
    for start in range(0, streams, CHUNK):
        size = min(CHUNK, streams - start)
        sums = RunningSums(size)
        code = {r: np.full(size, CONTINUE) for r in rules}
        at = {r: np.full(size, policy.max_requests) for r in rules}
        for offset in range(0, policy.max_requests, BLOCK):
            length = min(BLOCK, policy.max_requests - offset)
            summaries = sums.block(simulate(rng, size, length, candidate_acceptance))
            candidates = {"ours": (decision_codes(summaries, policy).codes, 1)}
            if naive:
                looks = np.arange(NAIVE_LOOK_EVERY - 1, length, NAIVE_LOOK_EVERY)
                thinned = {
                    arm: {
                        metric: MetricSummary(*(np.asarray(f)[:, looks] for f in (v.n, v.mean, v.variance)))
                        for metric, v in by_metric.items()
                    }
                    for arm, by_metric in summaries.items()
                }
                candidates["naive"] = (naive_codes(thinned, policy), NAIVE_LOOK_EVERY)
            for rule, (codes, stride) in candidates.items():
                first, index = first_decision(codes)
                new = (code[rule] == CONTINUE) & (first != CONTINUE)
                code[rule] = np.where(new, first, code[rule])
                at[rule] = np.where(new, offset + (index + 1) * stride, at[rule])
            if all((code[r] != CONTINUE).all() for r in rules):
                break
        for r in rules:
            out[f"{r}_code"].append(np.where(code[r] == CONTINUE, INCONCLUSIVE, code[r]))
            out[f"{r}_at"].append(at[r])
    return {key: np.concatenate(parts) for key, parts in out.items()}


def cross_check(rng: np.random.Generator, policy: CanaryPolicy, effect: float) -> int:
    """The vectorised rule and ``decide`` agree request by request on a few streams (count checked)."""
    s = simulate(rng, 2, 1_500, acceptance_for_effect(effect))
    codes = decision_codes(running_summaries(s), policy).codes
    checked = 0
    for stream in range(2):
        arms = {arm: ArmAccumulator() for arm in ARMS}
        for i in range(s.arm.shape[1]):
            arms[ARMS[s.arm[stream, i]]].add(
                tokens_per_step=float(s.tokens_per_step[stream, i]),
                latency_ms_per_token=float(s.latency_ms_per_token[stream, i]),
            )
            if i % 50 == 49:
                scalar = decide(arms, policy).decision
                # decide() reports SRM/limits the same way; here neither applies.
                if scalar != DECISION_NAMES[int(codes[stream, i])]:
                    raise AssertionError(
                        f"decide() says {scalar} where the vectorised rule says {codes[stream, i]}"
                    )
                checked += 1
    return checked


def _quantiles(values: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(values)), "p90": float(np.quantile(values, 0.9))}


def run_simulation(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Run the simulation, print its table, return the figures (see the module docstring)."""
    started = time.perf_counter()
    policy = CanaryPolicy()  # the defaults the service uses unless a deployment overrides them
    rng = np.random.default_rng(seed)
    null_streams = 150 if quick else 1_000
    effect_streams = 30 if quick else 200

    checked = cross_check(rng, policy, 0.10)
    null = run_cell(rng, policy, null_streams, 0.0, naive=True)
    false_promotion = float(np.mean(null["ours_code"] == PROMOTE))
    naive_false_promotion = float(np.mean(null["naive_code"] == PROMOTE))
    false_rejection = float(np.mean(null["ours_code"] == REJECT))
    se = math.sqrt(max(false_promotion * (1 - false_promotion), 1e-12) / null_streams)

    by_effect: dict[str, Any] = {}
    for effect in (*EFFECTS, HARM_EFFECT):
        cell = run_cell(rng, policy, effect_streams, effect, naive=False)
        wanted = REJECT if effect < 0 else PROMOTE
        hit = cell["ours_code"] == wanted
        requests = np.where(hit, cell["ours_at"], policy.max_requests)
        by_effect[f"{effect:+.0%}"] = {
            "effect": effect,
            "candidate_acceptance": acceptance_for_effect(effect),
            "expected_decision": DECISION_NAMES[wanted],
            "share_decided_correctly": float(np.mean(hit)),
            "share_promoted": float(np.mean(cell["ours_code"] == PROMOTE)),
            "share_rejected": float(np.mean(cell["ours_code"] == REJECT)),
            "share_inconclusive": float(np.mean(cell["ours_code"] == INCONCLUSIVE)),
            "requests": _quantiles(requests),
        }

    result: dict[str, Any] = {
        "alpha": policy.alpha,
        "false_promotion_rate": false_promotion,
        "false_promotion_rate_se": se,
        "naive_false_promotion_rate": naive_false_promotion,
        "naive_look_every": NAIVE_LOOK_EVERY,
        "false_rejection_rate_null": false_rejection,
        "requests_to_decide": {k: v["requests"] for k, v in by_effect.items() if v["effect"] > 0},
        "effects": by_effect,
        "simulated_streams": {"null": null_streams, "per_effect": effect_streams},
        "policy": policy.as_dict(),
        "model": {
            "k": K,
            "cost_ratio": COST_RATIO,
            "verify_cost": VERIFY_COST,
            "incumbent_acceptance": INCUMBENT_ACCEPTANCE,
            "acceptance_concentration": KAPPA,
            "mean_verify_steps": 1 + MEAN_STEPS,
            "load_sigma": LOAD_SIGMA,
            "weights": WEIGHTS,
            "monitoring": "rule evaluated after every request",
        },
        "decide_cross_checks": checked,
        "seed": seed,
        "quick": quick,
        "wall_s": time.perf_counter() - started,
    }
    _print_table(result)
    return result


def _print_table(r: dict[str, Any]) -> None:
    print(
        f"canary decision rule on simulated streams (alpha = {r['alpha']}, weights {WEIGHTS}, "
        f"max {r['policy']['max_requests']} requests, min {r['policy']['min_samples_per_arm']} per arm)"
    )
    print(f"  null streams (candidate = incumbent): {r['simulated_streams']['null']}")
    print(
        f"  false promotion, always-valid rule, checked every request: {r['false_promotion_rate']:.3f} "
        f"(+/- {r['false_promotion_rate_se']:.3f})"
    )
    print(
        f"  false promotion, naive fixed-sample test every {r['naive_look_every']} requests: "
        f"{r['naive_false_promotion_rate']:.3f}"
    )
    print(f"  false rejection under the null (always-valid rule): {r['false_rejection_rate_null']:.3f}")
    print(
        f"  {'true effect':>12} {'expected':>9} {'correct':>8} {'inconcl.':>9} "
        f"{'median req':>11} {'p90 req':>8}"
    )
    for name, e in r["effects"].items():
        print(
            f"  {name:>12} {e['expected_decision']:>9} {e['share_decided_correctly']:>8.2f} "
            f"{e['share_inconclusive']:>9.2f} {e['requests']['median']:>11.0f} {e['requests']['p90']:>8.0f}"
        )
    print(f"  ({r['simulated_streams']['per_effect']} streams per effect; {r['wall_s']:.1f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer streams (for iteration)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = run_simulation(quick=args.quick, seed=args.seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "canary_sim.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
