#!/usr/bin/env bash
# Makes the local base images of the CPU build (images/build.sh --cpu) without any container registry: a root
# filesystem from the distribution's archive with debootstrap, its packages installed with apt in a chroot,
# imported with `podman import` (or `docker import`). Cached: a base whose image exists, or whose tar is in the
# cache folder, is not made again; a change to this script makes new ones (its hash is in the tag).
#
#   images/local-base.sh [CACHE_DIR]     # default: .cache/images; prints "kind image" lines
#
# Bases, each with the packages the Dockerfiles' apt-get steps pin already installed (those steps then find them
# installed and need no network; the bases carry no apt source, so nothing else can be installed by mistake):
#   runtime  Ubuntu 24.04 (the GPU images' distribution): python3.12, pip, venv, Open MPI, OpenSSH  (training, engine)
#   devel    runtime + cmake, g++, make, libopenmpi-dev, python3.12-dev              (training's builder stage)
#   mlflow   Debian 12 (the python:3.11-slim-bookworm of the GPU build): python3, venv, pip       (mlflow)
# Needs root, debootstrap and access to archive.ubuntu.com and deb.debian.org.
set -euo pipefail

root_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${1:-$root_dir/.cache/images}"
docker="${DOCKER:-podman}"
ubuntu_mirror="${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}"
debian_mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Ubuntu's archive key ring, from Ubuntu's package (Debian 12 does not ship it), checked by its sha256
keyring_deb="pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"
keyring_sha256="36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8"

runtime_packages=(python3 python3-pip python3.12 python3.12-venv openmpi-bin openssh-client openssh-server ca-certificates)
devel_packages=(cmake g++ make libopenmpi-dev python3.12-dev)
mlflow_packages=(python3 python3-venv python3-pip ca-certificates)

fail() {
    echo "images/local-base.sh: $*" >&2
    exit 1
}

command -v debootstrap >/dev/null || fail "debootstrap not found: apt-get install debootstrap"
command -v "$docker" >/dev/null || fail "$docker not found: apt-get install podman runc (or set DOCKER=docker)"
((EUID == 0)) || fail "debootstrap needs root"

version="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
mkdir -p "$cache"

image_exists() { "$docker" image inspect "$1" >/dev/null 2>&1; }

in_chroot() {  # in_chroot ROOT COMMAND...: with /proc and the host's resolver, for apt and maintainer scripts
    local root="$1"
    shift
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    mount -t proc proc "$root/proc"
    local status=0
    DEBIAN_FRONTEND=noninteractive LC_ALL=C chroot "$root" "$@" || status=$?
    umount "$root/proc"
    return "$status"
}

strip_apt() {  # no sources, no lists, no caches: the image installs nothing more, and is smaller
    local root="$1"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
        "$root"/etc/apt/sources.list.d/* "$root"/etc/ssh/ssh_host_* "$root"/debootstrap
    : >"$root/etc/apt/sources.list"
    : >"$root/etc/resolv.conf"
}

import() {  # import ROOT TAR IMAGE: the root filesystem as TAR (kept in the cache), imported as IMAGE
    tar --numeric-owner -C "$1" -cf "$2.part" . && mv "$2.part" "$2"
    "$docker" import "$2" "$3" >/dev/null
}

make_base() {  # make_base KIND IMAGE SUITE MIRROR KEYRING_ARGS COMPONENTS POCKETS PACKAGES...
    local kind="$1" image="$2" suite="$3" mirror="$4" keyring="$5" components="$6" pockets="$7"
    shift 7
    local tarball="$cache/base-$kind-$version.tar"
    if image_exists "$image"; then return 0; fi
    if [[ -f "$tarball" ]]; then
        "$docker" import "$tarball" "$image" >/dev/null
        return 0
    fi
    local work
    work="$(mktemp -d "$cache/rootfs.XXXXXX")"
    echo "images/local-base.sh: $image: debootstrap $suite (a few minutes)" >&2
    local args=(--variant=minbase "--components=${components// /,}")
    if [[ -n "$keyring" ]]; then args+=("--keyring=$keyring"); fi
    local script=()  # an older debootstrap knows no noble: Ubuntu's releases all use its gutsy script
    if [[ ! -e "/usr/share/debootstrap/scripts/$suite" ]]; then script=(/usr/share/debootstrap/scripts/gutsy); fi
    debootstrap "${args[@]}" "$suite" "$work/root" "$mirror" "${script[@]}" >"$cache/debootstrap-$kind.log" 2>&1 \
        || fail "debootstrap $suite failed: see $cache/debootstrap-$kind.log"
    local pocket
    for pocket in $pockets; do echo "deb $mirror $pocket $components"; done >"$work/root/etc/apt/sources.list"
    in_chroot "$work/root" sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends $*" \
        >>"$cache/debootstrap-$kind.log" 2>&1 || fail "apt-get install in $suite failed: see $cache/debootstrap-$kind.log"
    strip_apt "$work/root"
    import "$work/root" "$tarball" "$image"
    rm -rf "$work"
}

ubuntu_keyring="$cache/ubuntu-archive-keyring.gpg"
if [[ ! -f "$ubuntu_keyring" ]]; then
    deb="$cache/ubuntu-keyring.deb"
    curl -fsS -m 60 -o "$deb" "$ubuntu_mirror/$keyring_deb" || fail "cannot download $ubuntu_mirror/$keyring_deb"
    echo "$keyring_sha256  $deb" | sha256sum --check --quiet - || fail "$deb: sha256 mismatch"
    dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/share/keyrings/ubuntu-archive-keyring.gpg >"$ubuntu_keyring"
    rm -f "$deb"
fi

runtime="localhost/qatpipe-base:noble-$version"
devel="localhost/qatpipe-base:noble-devel-$version"
mlflow="localhost/qatpipe-base:bookworm-$version"
make_base runtime "$runtime" noble "$ubuntu_mirror" "$ubuntu_keyring" "main universe" \
    "noble noble-updates noble-security" "${runtime_packages[*]}"
# devel: the runtime root filesystem plus the compilers, as its own tar
if ! image_exists "$devel"; then
    if [[ -f "$cache/base-devel-$version.tar" ]]; then
        "$docker" import "$cache/base-devel-$version.tar" "$devel" >/dev/null
    else
        work="$(mktemp -d "$cache/rootfs.XXXXXX")"
        mkdir "$work/root"
        if [[ ! -f "$cache/base-runtime-$version.tar" ]]; then  # the image without its tar: export it
            cid="$("$docker" create "$runtime" true)"
            "$docker" export -o "$cache/base-runtime-$version.tar" "$cid"
            "$docker" rm "$cid" >/dev/null
        fi
        tar -C "$work/root" -xf "$cache/base-runtime-$version.tar"
        for pocket in noble noble-updates noble-security; do
            echo "deb $ubuntu_mirror $pocket main universe"
        done >"$work/root/etc/apt/sources.list"
        in_chroot "$work/root" sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends \
            ${devel_packages[*]}" >>"$cache/debootstrap-devel.log" 2>&1 \
            || fail "apt-get install of the compilers failed: see $cache/debootstrap-devel.log"
        strip_apt "$work/root"
        import "$work/root" "$cache/base-devel-$version.tar" "$devel"
        rm -rf "$work"
    fi
fi
make_base mlflow "$mlflow" bookworm "$debian_mirror" "" "main" \
    "bookworm bookworm-updates" "${mlflow_packages[*]}"

printf 'runtime %s\ndevel %s\nmlflow %s\n' "$runtime" "$devel" "$mlflow"
