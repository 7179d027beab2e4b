#!/bin/sh
# Credentials for `docker compose up`: random NATS and Postgres passwords, and the URLs the Shoal
# services read from /run/secrets (pydantic-settings' secrets_dir). Written once into ./secrets
# (a 0700 directory: other users of the host cannot read them); run again with --force to renew.
set -eu
cd "$(dirname "$0")/.."
if [ -e secrets/nats_password ] && [ "${1:-}" != "--force" ]; then
  echo "secrets/ exists already (use --force to make new ones)"; exit 0
fi
umask 077
mkdir -p secrets && chmod 700 secrets
gen() { python3 -c 'import secrets; print(secrets.token_urlsafe(24))'; }
NATS_PASSWORD=$(gen)
POSTGRES_PASSWORD=$(gen)
printf '%s' "$NATS_PASSWORD" > secrets/nats_password
printf '%s' "$POSTGRES_PASSWORD" > secrets/postgres_password
# every server of the NATS cluster: a client moves to another when its server is lost
printf 'nats://shoal:%s@nats:4222,nats://shoal:%s@nats-2:4222,nats://shoal:%s@nats-3:4222' \
  "$NATS_PASSWORD" "$NATS_PASSWORD" "$NATS_PASSWORD" > secrets/shoal_nats_url
printf 'postgresql+asyncpg://shoal:%s@postgres:5432/shoal' "$POSTGRES_PASSWORD" \
  > secrets/shoal_database_url
# the files themselves are bind-mounted as they are: readable inside the containers (whose user
# differs from yours), guarded on the host by the 0700 directory
chmod 644 secrets/*
echo "wrote secrets/ (nats_password, postgres_password, shoal_nats_url, shoal_database_url)"
