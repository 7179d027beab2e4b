#!/bin/sh
# The official postgres image's contract, as compose.yaml uses it: on an empty $PGDATA, initdb
# with POSTGRES_USER and the password of POSTGRES_PASSWORD(_FILE), create POSTGRES_DB, accept
# password (scram) logins over TCP; then run the server as the postgres user.
set -eu
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown -R postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then cat "$POSTGRES_PASSWORD_FILE" > "$pwfile"
  else printf '%s' "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE}" > "$pwfile"; fi
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  # the official image's init phase: a socket-only server (a TCP health check fails meanwhile)
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  if [ "$db" != postgres ]; then createdb -U "$user" -h /var/run/postgresql "$db"; fi
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "postgres stand-in: initialised $PGDATA (user $user, database $db)"
fi
if [ "${1:-}" = postgres ]; then shift; fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
