#!/usr/bin/env bash
# Sourced by the .ci/setup_*.sh scripts: `apt_install PKG...` installs Debian packages
# quietly, as root (CI) or through sudo elsewhere.
apt_install() {
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo="sudo"
  fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
