#!/bin/sh
# The settings the host's `shoal` CLI needs to manage the compose stack, as shell exports:
#   eval "$(infra/compose-env.sh)"   then: shoal workers list, shoal models deploy ...
# compose.yaml publishes its NATS on 127.0.0.1:${SHOAL_COMPOSE_NATS_PORT:-4222} with the password
# infra/compose-secrets.sh wrote; every compose service runs in namespace `compose`.
set -eu
cd "$(dirname "$0")/.."
if [ ! -r secrets/nats_password ]; then
  echo "infra/compose-env.sh: no secrets/nats_password: run infra/compose-secrets.sh first" >&2
  exit 1
fi
printf "export SHOAL_NATS_URL='nats://shoal:%s@127.0.0.1:%s'\n" "$(cat secrets/nats_password)" \
  "${SHOAL_COMPOSE_NATS_PORT:-4222}"
echo "export SHOAL_NAMESPACE=compose"
