#!/usr/bin/env bash
# Provides the four images the Dockerfile and docker-compose.yml name. An image already there
# is kept; a missing one is pulled if a registry answers, else (no registry is reachable on
# the project's machines) a local stand-in is built from Debian bookworm packages
# (FORCE=1 rebuilds every stand-in).
#   debian:bookworm-slim   debootstrap --variant=minbase, imported
#   redis:7-alpine         Debian's redis-server 7.0, protected mode off like the official image
#   rabbitmq:4-management  Debian's rabbitmq-server 3.10 + management plugin
#                          (reads RABBITMQ_DEFAULT_USER / RABBITMQ_DEFAULT_PASS itself)
#   rust:1-bookworm        build tools + this host's stable Rust toolchain
# Needs root, a running dockerd (scripts/docker-setup.sh), debootstrap, the Debian archive and
# a stable toolchain under ~/.rustup with ~/.cargo/bin.
set -euo pipefail
DOCKER=/usr/bin/docker # Debian's CLI, matching the daemon docker-setup.sh starts
[ -x $DOCKER ] || DOCKER=docker
WORK=${DOCKER_STATE_DIR:-/var/tmp/redisched-docker}
# the Debian mirror the host's apt uses
MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null)}
[ -n "$MIRROR" ] || { echo "docker-images: set MIRROR to a Debian mirror URL"; exit 1; }
mkdir -p "$WORK"
missing() { [ "${FORCE:-0}" = 1 ] || ! $DOCKER image inspect "$1" >/dev/null 2>&1; }
timed() {
    local what=$1 t0
    shift
    t0=$(date +%s)
    "$@"
    echo "docker-images: $what built in $(($(date +%s) - t0)) s"
}

debian_slim() {
    local root=$WORK/rootfs
    rm -rf "$root"
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; return 1; }
    rm -f "$root/etc/apt/sources.list"
    cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # as in the official slim image: services do not start on install, no docs, no apt caches
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod +x "$root/usr/sbin/policy-rc.d"
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
        'path-exclude /usr/share/locale/*' >"$root/etc/dpkg/dpkg.cfg.d/docker-slim"
    cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    mkdir -p "$root/var/lib/apt/lists/partial"
    tar -C "$root" -c . | $DOCKER import -c 'CMD ["bash"]' - debian:bookworm-slim >/dev/null
    rm -rf "$root"
}

redis_image() {
    local dir=$WORK/img-redis
    rm -rf "$dir" && mkdir -p "$dir"
    cat >"$dir/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# As the official image: options alone mean redis-server; protected mode off unless the
# command line says otherwise; runs as user redis with its data in /data.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ]; then
    shift
    conf=""
    case "${1:-}" in -*|"") ;; *) conf=$1; shift ;; esac
    set -- redis-server $conf --protected-mode no "$@"
    if [ "$(id -u)" = 0 ]; then
        chown -R redis:redis /data 2>/dev/null || true
        exec setpriv --reuid=redis --regid=redis --init-groups "$@"
    fi
fi
exec "$@"
EOF
    cat >"$dir/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /data && chown redis:redis /data
COPY docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod +x /usr/local/bin/docker-entrypoint.sh
VOLUME /data
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
EOF
    $DOCKER build -q -t redis:7-alpine "$dir" >/dev/null
}

rabbitmq_image() {
    local dir=$WORK/img-rabbitmq
    rm -rf "$dir" && mkdir -p "$dir"
    cat >"$dir/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# Logs to stdout, runs as user rabbitmq. The CLI tools (rabbitmq-diagnostics, run as root by
# health checks) go through Debian's wrapper, which switches to rabbitmq and so shares the cookie.
set -e
if [ "$1" = rabbitmq-server ]; then
    shift
    chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq /etc/rabbitmq
    cd /var/lib/rabbitmq
    exec setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups \
        env HOME=/var/lib/rabbitmq /usr/lib/rabbitmq/bin/rabbitmq-server "$@"
fi
exec "$@"
EOF
    cat >"$dir/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends rabbitmq-server \
    && rm -rf /var/lib/apt/lists/* \
    && rabbitmq-plugins enable --offline rabbitmq_management \
    && : >/etc/rabbitmq/rabbitmq-env.conf \
    && mkdir -p /etc/rabbitmq/conf.d \
    && printf '%s\n' 'loopback_users.guest = false' 'listeners.tcp.default = 5672' \
         'management.tcp.port = 15672' >/etc/rabbitmq/conf.d/10-defaults.conf
COPY docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod +x /usr/local/bin/docker-entrypoint.sh
ENV RABBITMQ_LOGS=-
VOLUME /var/lib/rabbitmq
EXPOSE 4369 5671 5672 15671 15672 25672
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["rabbitmq-server"]
EOF
    $DOCKER build -q -t rabbitmq:4-management "$dir" >/dev/null
}

rust_image() {
    local dir=$WORK/img-rust toolchain=stable-x86_64-unknown-linux-gnu
    local rustup=${RUSTUP_HOME:-$HOME/.rustup}
    [ -d "$rustup/toolchains/$toolchain" ] || { echo "docker-images: no $rustup/toolchains/$toolchain"; return 1; }
    rm -rf "$dir" && mkdir -p "$dir/rustup/toolchains" "$dir/cargo" "$dir/ca"
    # the toolchain without its HTML docs (800 MB)
    tar -C "$rustup/toolchains" --exclude="$toolchain/share/doc" -cf - "$toolchain" \
        | tar -C "$dir/rustup/toolchains" -xf -
    printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\n' "$toolchain" \
        >"$dir/rustup/settings.toml"
    cp -a "${CARGO_HOME:-$HOME/.cargo}/bin" "$dir/cargo/bin"
    # the extra CA certificates the host trusts, so cargo in the build reaches the crate registry
    cp /usr/local/share/ca-certificates/*.crt "$dir/ca/" 2>/dev/null || true
    cat >"$dir/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential pkg-config libssl-dev \
         ca-certificates curl git \
    && rm -rf /var/lib/apt/lists/*
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY rustup /usr/local/rustup
COPY cargo /usr/local/cargo
RUN rustc --version && cargo --version
EOF
    $DOCKER build -q -t rust:1-bookworm "$dir" >/dev/null
    rm -rf "$dir/rustup" "$dir/cargo"
}

# Each image: present, else pulled (a registry answers), else a stand-in built here.
provide() {
    local image=$1 builder=$2
    missing "$image" || return 0
    if [ "${FORCE:-0}" != 1 ] && timeout 900 $DOCKER pull -q "$image" >/dev/null 2>&1; then
        echo "docker-images: $image pulled"
        return 0
    fi
    timed "$image (stand-in)" "$builder"
}
provide debian:bookworm-slim debian_slim # the base of the other stand-ins: first
provide redis:7-alpine redis_image
provide rabbitmq:4-management rabbitmq_image
provide rust:1-bookworm rust_image
$DOCKER images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E '^(debian:bookworm-slim|redis:7-alpine|rabbitmq:4-management|rust:1-bookworm) '
