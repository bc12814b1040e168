#!/usr/bin/env bash
# Makes the base images docker/Dockerfile and the compose Redis need from Debian's packages, for a host that
# cannot pull python:3.11-slim and redis:7 (no registry answers). Each is a Debian bookworm minbase made with
# debootstrap and `docker import`ed; an image that already exists is kept.
#   pagedserve-base/python:3.11-bookworm   Python 3.11 with venv and the CA bundle (BASE_IMAGE)
#   pagedserve-base/redis:7.0-bookworm     redis-server 7.0 (REDIS_IMAGE)
# Needs root, debootstrap (apt-get install debootstrap) and a Docker daemon. MIRROR picks the Debian mirror.
set -euo pipefail

MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PYTHON_IMAGE=${PYTHON_IMAGE:-pagedserve-base/python:3.11-bookworm}
REDIS_IMAGE=${REDIS_IMAGE:-pagedserve-base/redis:7.0-bookworm}

command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }

# make_image TAG PACKAGES [docker import --change ...]
make_image() {
  local tag=$1 packages=$2
  shift 2
  if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag: present"
    return
  fi
  local root
  root=$(mktemp -d /var/tmp/pagedserve-rootfs.XXXXXX)
  echo "base image $tag: debootstrap $SUITE with $packages"
  debootstrap --variant=minbase --include="$packages" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; exit 1; }
  # Only what the image runs with: no package lists, caches, docs or man pages.
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
  tar -C "$root" -c . | docker import "$@" - "$tag" >/dev/null
  rm -rf "$root" "$root.log"
  echo "base image $tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
}

make_image "$PYTHON_IMAGE" python3,python3-venv,ca-certificates \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]'
make_image "$REDIS_IMAGE" redis-server \
  --change 'WORKDIR /data' --change 'EXPOSE 6379' --change 'CMD ["redis-server"]'
