"""What actuators are told, pure: webhook signatures (computed, verified, refused when stale or
tampered with), the per-deployment secret, the payload with vLLM's and SGLang's arguments, and
the retry schedule."""

from __future__ import annotations

import hashlib
import hmac
import json

from controlplane.fleet import payloads


def test_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    body = b'{"event":"promotion"}'
    expected = hmac.new(b"whsec_x", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert payloads.sign("whsec_x", 1700000000, body) == f"sha256={expected}"


def test_verify_accepts_the_signed_body_and_refuses_tampering_staleness_and_other_secrets() -> None:
    body = payloads.encode({"event": "rollback", "k": 4})
    headers = payloads.signed_headers("s1", "rollback", 9, body, now=1_000_000.0)
    ts, sig = headers[payloads.HEADER_TIMESTAMP], headers[payloads.HEADER_SIGNATURE]
    assert headers[payloads.HEADER_EVENT] == "rollback" and headers[payloads.HEADER_DELIVERY] == "9"
    assert payloads.verify("s1", ts, body, sig, now=1_000_010.0)
    assert not payloads.verify("s2", ts, body, sig, now=1_000_010.0)  # another deployment's secret
    assert not payloads.verify("s1", ts, body + b" ", sig, now=1_000_010.0)  # body changed
    assert not payloads.verify("s1", str(int(ts) + 1), body, sig, now=1_000_010.0)  # timestamp changed
    assert not payloads.verify("s1", ts, body, sig, now=1_000_000.0 + payloads.SIGNATURE_TOLERANCE_S + 1)
    assert not payloads.verify("s1", None, body, sig) and not payloads.verify("s1", ts, body, None)
    assert not payloads.verify("s1", "not-a-number", body, sig)


def test_secret_is_derived_per_deployment_and_nonce() -> None:
    first = payloads.derive_secret("key", 1, "n1")
    assert first == payloads.derive_secret("key", 1, "n1")  # derivable: nothing stored in clear
    assert first.startswith("whsec_")
    assert len({first, payloads.derive_secret("key", 2, "n1"), payloads.derive_secret("key", 1, "n2")}) == 3
    assert payloads.derive_secret("other-key", 1, "n1") != first


def test_payload_carries_engine_arguments_for_a_local_artifact() -> None:
    payload = payloads.build_payload(
        event=payloads.EVENT_CANARY_START,
        delivery_id=3,
        deployment="accounts/acme/deployments/svc",
        account="acme",
        canary_id=7,
        drafter_version=2,
        artifact_uri="file:///srv/drafters/v2",
        manifest_sha256="ab" * 32,
        k=5,
        ready_callback_url="https://cp/v1/accounts/acme/deployments/svc/canaries/7/ready",
        created_at="2026-12-02T00:00:00+00:00",
    )
    assert set(payload) == {
        "event",
        "delivery_id",
        "deployment",
        "account",
        "canary_id",
        "drafter_version",
        "artifact",
        "k",
        "drafter_kind",
        "vllm_speculative_config",
        "sglang_args",
        "sglang_draft_config",
        "ready_callback_url",
        "created_at",
    }
    assert payload["artifact"] == {"uri": "file:///srv/drafters/v2", "manifest_sha256": "ab" * 32}
    # Exactly what `vllm serve --speculative-config '<json>'` takes for a draft model.
    assert payload["vllm_speculative_config"] == {
        "method": "draft_model",
        "model": "/srv/drafters/v2",
        "num_speculative_tokens": 5,
    }
    args = payload["sglang_args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {
        "--speculative-algorithm": "STANDALONE",
        "--speculative-draft-model-path": "/srv/drafters/v2",
        "--speculative-num-steps": "5",
        "--speculative-eagle-topk": "1",
        "--speculative-num-draft-tokens": "6",
    }
    assert payload["drafter_kind"] == "draft_model" and payload["sglang_draft_config"] is None
    assert json.loads(payloads.encode(payload)) == payload


def test_a_head_is_served_as_eagle3_by_both_engines() -> None:
    payload = payloads.build_payload(
        event=payloads.EVENT_PROMOTION,
        delivery_id=4,
        deployment="accounts/acme/deployments/svc",
        account="acme",
        canary_id=None,
        drafter_version=3,
        artifact_uri="file:///srv/drafters/v3",
        manifest_sha256="cd" * 32,
        k=4,
        ready_callback_url=None,
        created_at="2026-12-02T00:00:00+00:00",
        drafter_kind="eagle3",
    )
    assert payload["drafter_kind"] == "eagle3"
    assert payload["vllm_speculative_config"] == {
        "method": "eagle3",
        "model": "/srv/drafters/v3",
        "num_speculative_tokens": 4,
    }
    flags = dict(zip(payload["sglang_args"][::2], payload["sglang_args"][1::2], strict=True))
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-num-draft-tokens"] == "5"
    # SGLang reads no speculators config: the artifact's SGLang config is named for the fleet.
    assert payload["sglang_draft_config"] == "config.sglang.json"


def test_payload_without_a_drafter_names_no_model_and_remote_uris_pass_through() -> None:
    common = {
        "delivery_id": 1,
        "deployment": "accounts/a/deployments/d",
        "account": "a",
        "canary_id": None,
        "manifest_sha256": None,
        "k": 4,
        "ready_callback_url": None,
        "created_at": "2026-12-02T00:00:00+00:00",
    }
    bare = payloads.build_payload(event="rollback", drafter_version=None, artifact_uri=None, **common)
    assert (
        bare["artifact"] is None and bare["vllm_speculative_config"] is None and bare["sglang_args"] is None
    )
    remote = payloads.build_payload(event="promotion", drafter_version=4, artifact_uri="s3://b/v4", **common)
    assert remote["vllm_speculative_config"]["model"] == "s3://b/v4"


def test_backoff_doubles_up_to_a_cap_then_gives_up() -> None:
    delays = [payloads.backoff(n) for n in range(1, payloads.MAX_ATTEMPTS + 1)]
    seconds = [d.total_seconds() for d in delays if d is not None]
    assert seconds[:4] == [10.0, 20.0, 40.0, 80.0]
    assert all(b >= a for a, b in zip(seconds, seconds[1:], strict=False))
    assert max(seconds) <= payloads.BACKOFF_MAX_S
    assert len(seconds) == payloads.MAX_ATTEMPTS - 1 and delays[-1] is None  # the last attempt fails for good
