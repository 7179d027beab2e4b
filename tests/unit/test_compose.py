"""compose.yaml: the official images with health checks, services built from infra/Dockerfile.

`make compose-test` (tests/compose) runs the stack for real where Docker is; this test keeps the
file's shape from drifting on machines without it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_shape() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert services["nats"]["image"].startswith("nats:") and "-js" in services["nats"]["command"]
    assert services["postgres"]["image"].startswith("postgres:")
    for name in ("nats", "postgres"):
        assert services[name]["healthcheck"]["test"], name
    assert services["registry"]["build"]["dockerfile"] == "infra/Dockerfile"
    assert services["registry"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["registry"]["depends_on"]["nats"]["condition"] == "service_healthy"
    env = services["registry"]["environment"]
    # credentials are secrets (infra/compose-secrets.sh), never in the file or the environment
    assert "SHOAL_NATS_URL" not in env and "SHOAL_DATABASE_URL" not in env
    assert "POSTGRES_PASSWORD" not in services["postgres"]["environment"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/secrets/")
    assert "nats_password" in services["nats"]["secrets"]
    assert "/run/secrets/nats_password" in " ".join(services["nats"]["entrypoint"])
    assert set(compose["secrets"]) == {"nats_password", "postgres_password", "shoal_nats_url",
                                       "shoal_database_url"}
    assert (ROOT / "infra" / "compose-secrets.sh").exists()
    assert services["worker"]["command"][0] == "worker"
    # every service of the stack runs, from the one image, against the same NATS and Postgres
    for name in ("scheduler", "worker", "gateway"):
        assert services[name]["image"] == services["registry"]["image"], name
        assert services[name]["environment"].items() >= env.items(), name
        assert services[name]["secrets"] == ["shoal_nats_url", "shoal_database_url"], name
    assert services["scheduler"]["command"] == ["scheduler"]
    assert services["gateway"]["command"] == ["gateway"]
    assert services["gateway"]["environment"]["SHOAL_GATEWAY_HOST"] == "0.0.0.0"
    # reached by its service name (Prometheus' http_sd url): an allowed Host
    assert "gateway" in services["gateway"]["environment"]["SHOAL_GATEWAY_ALLOWED_HOSTS"]
    assert services["gateway"]["ports"] == ["127.0.0.1:${SHOAL_COMPOSE_GATEWAY_PORT:-8000}:8000"]
    assert (ROOT / services["registry"]["build"]["dockerfile"]).exists()


def test_compose_serves_safely() -> None:
    """What the first real run found (issue 32): ports reachable from this machine only, a
    Postgres health check over TCP (a socket check passes during the image's init phase), a
    registry that waits for Postgres, engine logs in the worker's container log, converted
    models and built ops in a volume, an init that reaps what the services start."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    assert "-h 127.0.0.1" in services["postgres"]["healthcheck"]["test"][1]
    assert float(services["registry"]["environment"]["SHOAL_DATABASE_WAIT"]) >= 60
    worker = services["worker"]
    assert worker["environment"]["SHOAL_WORKER_ENGINE_LOG_STDOUT"] == "true"
    assert worker["volumes"] == ["shoal-cache:/var/cache/shoal"] and "shoal-cache" in compose[
        "volumes"]
    for name in ("registry", "scheduler", "worker", "gateway"):
        assert services[name]["init"] is True, name
    dockerfile = (ROOT / "infra/Dockerfile").read_text()
    assert "SHOAL_MODEL_CACHE_DIR=/var/cache/shoal/models" in dockerfile
    assert "TORCH_EXTENSIONS_DIR=/var/cache/shoal/torch_extensions" in dockerfile
    # engines run `python -m shoal`: the working directory must hold no `shoal/` source folder
    workdirs = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("WORKDIR")]
    assert workdirs[-1] == "/home/shoal"
    assert "download.pytorch.org/whl/cpu" in dockerfile  # never a CUDA torch
    # three NATS servers, routed to each other, the event stream on all three, and every
    # service given every server (infra/compose-secrets.sh)
    entry = services["nats"]["entrypoint"][2]
    for name in ("nats", "nats-2", "nats-3"):
        assert services[name]["entrypoint"][2] == entry, name
        assert f"@{name}:6222" in entry, name
    assert len({services[n]["environment"]["NATS_SERVER_NAME"]
                for n in ("nats", "nats-2", "nats-3")}) == 3
    assert services["registry"]["environment"]["SHOAL_NATS_STREAM_REPLICAS"] == "3"
    secrets_script = (ROOT / "infra/compose-secrets.sh").read_text()
    assert all(f"@{n}:4222" in secrets_script for n in ("nats", "nats-2", "nats-3"))
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignored and "!infra/wheels" in ignored  # allow-list: no venvs, no secrets


def test_settings_read_the_urls_from_docker_secrets(tmp_path: Path) -> None:
    """What the compose services do: SHOAL_* values from files named like them."""
    from shoal.shared.config import Settings

    (tmp_path / "shoal_nats_url").write_text("nats://shoal:pw@nats:4222\n")
    (tmp_path / "shoal_database_url").write_text("postgresql+asyncpg://shoal:pw@postgres/shoal")
    settings = Settings(_secrets_dir=tmp_path)
    assert settings.nats_url == "nats://shoal:pw@nats:4222"
    assert settings.database_url == "postgresql+asyncpg://shoal:pw@postgres/shoal"


def test_nats_carries_the_largest_request() -> None:
    """compose's NATS reads infra/nats/nats.conf, whose max_payload is the embedded server's,
    above the gateway's largest body (README "The largest request")."""
    from shoal.shared.config import Settings
    from shoal.shared.embedded import NATS_MAX_PAYLOAD

    nats = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["nats"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in nats["volumes"] if v.startswith("./")}
    conf = mounted["./infra/nats/nats.conf"]
    assert f"cat {conf} > /tmp/nats.conf" in nats["entrypoint"][2]
    text = (ROOT / "infra/nats/nats.conf").read_text()
    assert f"max_payload: {NATS_MAX_PAYLOAD}" in text.splitlines()
    assert Settings.model_fields["gateway_max_body_bytes"].default * 2 <= NATS_MAX_PAYLOAD
