"""docker-compose.yml cannot run here (no Docker engine); check its shape and that every command
it names exists in this package."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import yaml
from typer.main import get_command

from controlplane.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _cli_commands() -> set[str]:
    root = get_command(app)
    names = set()
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        names.add(name)
        for sub in getattr(command, "commands", {}):
            names.add(f"{name} {sub}")
    return names


def test_compose_services_have_healthchecks_and_no_secret_defaults() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"postgres", "redis", "api"} <= set(services)
    for name in ("postgres", "redis", "api"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    text = COMPOSE.read_text()
    # Secrets come from .env and fail loudly when missing (${VAR:?message}).
    assert "${POSTGRES_PASSWORD:?" in text and "${CONTROLPLANE_SECRET_KEY:?" in text


def test_every_controlplane_command_in_compose_exists() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    known = _cli_commands()
    used = []
    for service in spec["services"].values():
        command = service.get("command")
        if not command:
            continue
        line = " ".join(command) if isinstance(command, list) else command
        for part in line.split("&&"):
            words = shlex.split(part.replace("sh -c", ""))
            if "controlplane" in words:
                rest = words[words.index("controlplane") + 1 :]
                used.append(rest[0] if rest[0] in known else " ".join(rest[:2]))
    assert used, "compose names no controlplane command"
    assert set(used) <= known, set(used) - known


DEPLOY = COMPOSE.parent / "deploy"


def test_observability_services_are_provisioned_from_deploy_with_healthchecks() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    for name in ("flower", "prometheus", "grafana"):
        assert "healthcheck" in services[name], name
        assert services[name].get("depends_on"), name
    assert services["flower"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["prometheus"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    text = COMPOSE.read_text()
    for secret in ("FLOWER_BASIC_AUTH", "GRAFANA_ADMIN_PASSWORD", "PROMETHEUS_API_KEY_FILE"):
        assert "${" + secret + ":?" in text, secret
    # Every file compose mounts from the repository exists.
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE.parent / source).exists(), source
    assert services["prometheus"]["secrets"] == ["prometheus_api_key"]
    assert "prometheus_api_key" in spec["secrets"]


def test_prometheus_scrapes_the_api_with_a_key_and_grafana_reads_prometheus() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "specctl"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["api:8600"]
    assert job["authorization"]["credentials_file"] == "/run/secrets/prometheus_api_key"
    datasources = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["uid"] == "specctl-prometheus"
    providers = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "specctl.yml").read_text()
    )
    assert providers["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"


def test_grafana_dashboard_covers_hit_rate_accepted_length_drift_and_jobs() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "specctl.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in (
        "specctl_accepted_tokens_total",
        "specctl_drafted_tokens_total",
        "specctl_accepted_length_tokens",
        "specctl_drift_statistic",
        "specctl_jobs",
        "specctl_job_duration_seconds_bucket",
    ):
        assert metric in exprs, metric
    for panel in panels:
        assert panel["datasource"]["uid"] == "specctl-prometheus", panel["title"]


def test_the_reference_server_runs_with_its_own_key_and_an_existing_module() -> None:
    import argparse
    import importlib.util

    spec = yaml.safe_load(COMPOSE.read_text())
    serve = spec["services"]["serve"]
    command = serve["command"]
    assert command[:3] == ["python", "-m", "workers.serve"]
    assert importlib.util.find_spec("workers.serve.__main__") is not None
    assert "healthcheck" in serve and serve["depends_on"]["api"]["condition"] == "service_healthy"
    assert "serving_api_key" in serve["secrets"] and "serving_api_key" in spec["secrets"]
    # Every flag the compose file passes is one the server's own parser knows.
    from workers.serve.__main__ import build_parser

    parser: argparse.ArgumentParser = build_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    flags = {word for word in command if word.startswith("--")}
    assert flags <= known, flags - known


SERVE_GPU_OVERRIDE = DEPLOY / "compose.serve-gpu.yml"


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if "gpu" in d.get("capabilities", [])]


def test_only_services_that_run_on_a_gpu_reserve_one() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    reserving = {name for name, service in services.items() if _gpu_devices(service)}
    # Training and shadow replay run on the GPU worker; the reference engine runs on CPU.
    assert reserving == {"worker-gpu"}
    # A GPU serving engine is an override of the same service, named in the compose file's header.
    override = yaml.safe_load(SERVE_GPU_OVERRIDE.read_text())
    assert set(override["services"]) == {"serve"}
    assert set(override["services"]["serve"]) == {"deploy"}
    (device,) = _gpu_devices(override["services"]["serve"])
    assert device["driver"] == "nvidia" and device["count"] == 1
    assert f"-f {SERVE_GPU_OVERRIDE.relative_to(COMPOSE.parent)}" in COMPOSE.read_text()


def _environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {str(k): str(v) for k, v in environment.items()}


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target path: (source, mode) of each short-syntax volume."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        mounts[target] = (source, mode[0] if mode else "rw")
    return mounts


def test_the_gpu_worker_and_the_serving_side_share_one_artifact_store() -> None:
    from controlplane.artifacts.store import artifact_uri_is_supported

    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    worker, serve = services["worker-gpu"], services["serve"]
    uri = _environment(worker)["CONTROLPLANE_ARTIFACT_STORE_URI"]
    assert artifact_uri_is_supported(uri) and uri.startswith("file:///")
    store_path = uri.removeprefix("file://")
    # Every service running this package records and resolves the same URIs.
    for name, service in services.items():
        if service.get("image") == "specctl:latest":
            assert _environment(service)["CONTROLPLANE_ARTIFACT_STORE_URI"] == uri, name
            assert _mounts(service)[store_path][0] == "artifacts", name
    # One named volume, mounted at that path: written by the worker, read by the server.
    assert "artifacts" in spec["volumes"]
    assert _mounts(worker)[store_path] == ("artifacts", "rw")
    assert _mounts(serve)[store_path] == ("artifacts", "ro")


def test_env_example_names_every_variable_compose_requires() -> None:
    import re

    required = set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text()))
    example = {
        line.split("=")[0]
        for line in (COMPOSE.parent / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    }
    assert required <= example, required - example


def test_the_router_fronts_the_serving_container_with_a_valid_config() -> None:
    from controlplane.router.config import load_config

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    router = services["router"]
    assert router["depends_on"]["serve"]["condition"] == "service_healthy"
    assert "--no-report" in services["serve"]["command"]  # the router reports, once
    config = load_config(DEPLOY / "router.toml")
    [backend] = config.deployments[0].backends
    assert (
        config.deployments[0].name == "*"
        and backend.pool == "follower"
        and backend.url == "http://serve:8601"
    )


PUBLISH_LOCAL_OVERRIDE = DEPLOY / "compose.publish-local.yml"
# Services that authenticate no one (or hold the data): never on a network with a way out.
INTERNAL_ONLY = {"postgres", "redis", "router", "prometheus", "grafana", "flower", "beat"}


def test_only_the_api_publishes_a_port_and_the_rest_talk_on_an_internal_network() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {name for name, service in services.items() if service.get("ports")} == {"api"}
    assert services["api"]["ports"] == ["8600:8600"]
    assert spec["networks"]["internal"] == {"internal": True}
    for name, service in services.items():
        networks = set(service.get("networks") or spec["x-app"]["networks"])
        assert "internal" in networks, name
        assert networks <= set(spec["networks"]), name
        if name in INTERNAL_ONLY:
            assert networks == {"internal"}, name
    # The reference server and the router are reached by name on the internal network.
    assert services["serve"]["expose"] == ["8601"] and services["router"]["expose"] == ["8700"]
    # The opt-in override publishes on the host's loopback only, and only what asks for a password
    # or fronts the fleet.
    override = yaml.safe_load(PUBLISH_LOCAL_OVERRIDE.read_text())["services"]
    assert set(override) == {"router", "grafana", "flower"}
    for name, service in override.items():
        assert all(port.startswith("127.0.0.1:") for port in service["ports"]), name
    assert f"-f {PUBLISH_LOCAL_OVERRIDE.relative_to(COMPOSE.parent)}" in COMPOSE.read_text()


def test_redis_requires_a_password_that_every_client_presents() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    redis = spec["services"]["redis"]
    command = redis["command"]
    password = command[command.index("--requirepass") + 1]
    assert password.startswith("${REDIS_PASSWORD:?")
    assert _environment(redis)["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")
    text = COMPOSE.read_text()
    urls = [word for word in text.replace('"', " ").split() if "redis://" in word]
    assert len(urls) >= 3  # broker, results, Flower
    for url in urls:
        assert "redis://:${REDIS_PASSWORD:?" in url, url


def test_flower_and_grafana_ask_for_passwords() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert _environment(services["flower"])["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    grafana = _environment(services["grafana"])
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_USERS_ALLOW_SIGN_UP"] == "false"
