"""compose.yaml: the official images with health checks, services built from infra/Dockerfile.

No Docker engine runs on the build machines; `docker-compose config` (pip's docker-compose
1.29.2) validated the file once by hand (see README). This test keeps its shape from drifting.
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
    assert services["gateway"]["ports"] == ["8000:8000"]
    assert (ROOT / services["registry"]["build"]["dockerfile"]).exists()


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
