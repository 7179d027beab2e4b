#!/usr/bin/env bash
# Debian's Chromium, which the dashboard's browser test (tests/e2e/test_dashboard.py) drives with
# Playwright. Installed with apt-get when missing (as root: CI and the project's machines);
# Playwright never downloads a browser of its own.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || [ -n "${SHOAL_CHROMIUM:-}" ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "shoal: the browser test needs Chromium: run 'apt-get install chromium' as root," >&2
  echo "shoal: or point SHOAL_CHROMIUM at a Chromium binary" >&2
  exit 1
fi
echo "shoal: installing Debian's chromium for the browser test"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
