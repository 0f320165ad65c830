#!/usr/bin/env bash
# Install iproute2 (the `ip` command) so tests/test_multinode.py can build its test hosts: network
# namespaces joined by a bridge (tests/netns.py). Does nothing when `ip` is already there.
# Creating namespaces needs root (CI runs as root); the test fails in CI if it cannot.
set -euo pipefail

if PATH=$PATH:/usr/sbin:/sbin command -v ip >/dev/null 2>&1; then
  echo "setup_netns: iproute2 already installed ($(PATH=$PATH:/usr/sbin:/sbin command -v ip))"
  exit 0
fi

source "$(dirname "$0")/apt_install.sh"
apt_install iproute2

PATH=$PATH:/usr/sbin:/sbin command -v ip >/dev/null 2>&1 || { echo "setup_netns: ip still missing after apt-get install" >&2; exit 1; }
echo "setup_netns: installed iproute2 $(dpkg-query -W -f='${Version}' iproute2)"
