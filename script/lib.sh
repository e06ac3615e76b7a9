# Shared by script/build-image, script/run, script/test and ci/e2e.sh. Source it after setting $repo.
# shellcheck shell=bash
# $repo comes from the sourcing script; mmdebstrap's hook expands its own "$1".
# shellcheck disable=SC2154,SC2016
shopt -s inherit_errexit
: "${repo:?script/lib.sh needs repo= (the repository root) set before sourcing}"

log() { printf 'keel-image: %s\n' "$*" >&2; }
die() { printf 'keel-image: error: %s\n' "$*" >&2; exit 1; }

# podman with the optional storage driver override (KEEL_STORAGE_DRIVER=vfs where overlay
# cannot be used, e.g. when / itself is an overlay without kernel support for nesting).
pm() { podman ${KEEL_STORAGE_DRIVER:+--storage-driver "$KEEL_STORAGE_DRIVER"} "$@"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else die "need root for: $*"
    fi
}

apt_updated=0
apt_install() {
    [ "${KEEL_NO_INSTALL:-0}" = 1 ] && die "missing packages: $* (--no-install given)"
    command -v apt-get >/dev/null 2>&1 || die "missing $*; install them (this script knows apt only)"
    log "installing $*"
    if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq >&2; apt_updated=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

# start_moto LOG: moto_server (an S3 endpoint) on a 127.0.0.1 port it picks itself (`-p 0`:
# no other process can take a port between our choice and its bind); sets MOTO_PID, and
# MOTO_PORT once it says where it listens. Waits at most 180 s (a hang guard: python's start
# takes seconds on a loaded machine). Returns non-zero if it exits or never says.
start_moto() {
    local log=$1 i
    MOTO_PORT=""
    moto_server -H 127.0.0.1 -p 0 >"$log" 2>&1 &
    MOTO_PID=$!
    for ((i = 0; i < 1800; i++)); do
        MOTO_PORT=$(sed -n 's|.*Running on http://127\.0\.0\.1:\([0-9][0-9]*\).*|\1|p' "$log" | head -n 1)
        [ -n "$MOTO_PORT" ] && return 0
        kill -0 "$MOTO_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# need_tools CMD...: installs the Debian packages for whatever commands are missing.
need_tools() {
    local pkgs=() c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 && continue
        case "$c" in
            podman) pkgs+=(podman runc conmon containernetworking-plugins iptables uidmap slirp4netns fuse-overlayfs) ;;
            mmdebstrap) pkgs+=(mmdebstrap debian-archive-keyring) ;;
            cc) pkgs+=(gcc libc6-dev) ;;
            *) pkgs+=("$c") ;;
        esac
    done
    [ ${#pkgs[@]} -eq 0 ] || apt_install "${pkgs[@]}"
}

# need_cargo: a Rust toolchain new enough for the crate (Debian's rustc is too old).
need_cargo() {
    need_tools cc curl
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        [ "${KEEL_NO_INSTALL:-0}" = 1 ] && die "cargo is missing (--no-install given)"
        log "installing Rust with rustup (minimal profile)"
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >&2
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    local want have
    want="$(sed -n 's/^rust-version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)"
    have="$(rustc --version | awk '{print $2}')"
    if [ -n "$want" ] && [ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | head -n1)" != "$want" ]; then
        if command -v rustup >/dev/null 2>&1; then rustup update stable >&2
        else die "rustc $have is older than $want (install Rust with rustup)"
        fi
    fi
    KEEL_RUST_TARGET="${KEEL_RUST_TARGET:-$(rustc -vV | sed -n 's/^host: //p')}"
    export KEEL_RUST_TARGET
}

# build_keel: keel built on the host (cargo, static glibc binary) and staged as
# target/image/keel. Debian's own rustc is too old for the crate; a static glibc binary does
# not care which libc the image has.
build_keel() {
    need_cargo
    log "building keel (cargo build --release, static)"
    (cd "$repo" && RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
        cargo build --release --locked -p keel --target "$KEEL_RUST_TARGET")
    install -D -m 0755 "$repo/target/$KEEL_RUST_TARGET/release/keel" "$repo/target/image/keel"
}

# step WHAT CMD...: one line "keel: WHAT" on the terminal; CMD (in a subshell) writes into
# $KEEL_SETUP_LOG. When it fails: the log's last lines and its path, and exit 1.
step() {
    local what="$1"
    shift
    : "${KEEL_SETUP_LOG:?step needs KEEL_SETUP_LOG}"
    printf 'keel: %s\n' "$what" >&2
    printf '\n==> %s: %s\n' "$(date -u +%H:%M:%S)" "$what" >>"$KEEL_SETUP_LOG"
    # Not as an `if` condition: that would switch errexit off inside CMD.
    local rc errexit=0
    [[ $- == *e* ]] && errexit=1
    set +e
    (
        set -e
        "$@"
    ) >>"$KEEL_SETUP_LOG" 2>&1
    rc=$?
    [ "$errexit" = 0 ] || set -e
    if [ "$rc" != 0 ]; then
        printf 'keel: %s failed; the last lines of %s:\n' "$what" "$KEEL_SETUP_LOG" >&2
        tail -n 25 "$KEEL_SETUP_LOG" | sed 's/^/    /' >&2
        exit 1
    fi
}

setup_podman_env() {
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$repo/ci/containers.conf}"
}

# Packages of image/packages.txt, comments stripped, sorted, comma-separated.
image_packages() {
    sed -e 's/#.*//' "$repo/image/packages.txt" | tr -s ' \t' '\n' | sed '/^$/d' | sort -u | paste -sd, -
}

# ensure_base_image: prints the name of the base image, building and caching it when needed.
# The rootfs tarball is cached under $KEEL_CACHE_DIR, keyed by every input, so a rerun with
# the same package list costs nothing and a cold machine pays mmdebstrap (~2 min) once.
ensure_base_image() {
    local suite="${KEEL_SUITE:-bookworm}" mirror="${KEEL_DEBIAN_MIRROR:-}"
    local cache="${KEEL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/keel}"
    local pkgs key tarball name
    pkgs="$(image_packages)"
    local opts=(--variant=minbase --format=tar --include="$pkgs" --aptopt='Acquire::Retries "3"'
        --dpkgopt='path-exclude=/usr/share/man/*'
        --dpkgopt='path-exclude=/usr/share/info/*'
        --dpkgopt='path-exclude=/usr/share/doc/*'
        --dpkgopt='path-include=/usr/share/doc/*/copyright'
        --dpkgopt='path-exclude=/usr/share/locale/*'
        --dpkgopt='path-include=/usr/share/locale/locale.alias'
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin')
    key="$(printf '%s\n' v1 "$suite" "$mirror" "$(dpkg --print-architecture 2>/dev/null || uname -m)" "${opts[@]}" \
        | sha256sum | cut -c1-12)"
    name="localhost/keel-base:$suite-$key"
    if pm image exists "$name"; then echo "$name"; return; fi

    tarball="$cache/rootfs-$suite-$key.tar"
    if [ ! -s "$tarball" ]; then
        mkdir -p "$cache"
        log "building the $suite rootfs with mmdebstrap (cached as $tarball)"
        local tmp="$cache/.tmp-$$-rootfs.tar"
        # shellcheck disable=SC2064
        trap "rm -f '$tmp'" EXIT
        mmdebstrap "${opts[@]}" "$suite" "$tmp" ${mirror:+"$mirror"} >&2
        mv -f "$tmp" "$tarball"
        trap - EXIT
        # Older tarballs are for package lists no longer in use.
        find "$cache" -maxdepth 1 -name "rootfs-$suite-*.tar" ! -name "${tarball##*/}" -mtime +7 -delete 2>/dev/null || true
    fi
    log "importing $tarball as $name"
    pm import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        "$tarball" "$name" >/dev/null
    echo "$name"
}

# e2e_build_image IMAGE LOG: builds IMAGE for an end-to-end script (with $KEEL_E2E_BIN in it
# when set) and says how long it took; on failure prints the build log and a failed run's
# closing line, and returns 1.
e2e_build_image() {
    local t0
    t0=$(date +%s)
    if ! "$repo/script/build-image" --quiet --tag "$1" ${KEEL_E2E_BIN:+--bin "$KEEL_E2E_BIN"} \
            >"$2" 2>&1; then
        cat "$2" >&2
        echo "image build failed"
        echo "0 passed, 1 failed"
        return 1
    fi
    echo "# image $1 built in $(( $(date +%s) - t0 ))s"
}
