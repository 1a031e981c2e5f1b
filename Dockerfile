# Multi-stage build: compile in the Rust image, run in a slim Debian with only the binary.
#   docker build -t redisched .
#   docker run --rm redisched --help
# docker-compose.yml runs it with the whole stack (Redis, RabbitMQ); scripts/compose-test.sh
# builds and starts that stack for real in CI.

FROM rust:1-bookworm AS build
WORKDIR /src
# Dependencies first, in their own layer: a change to the sources alone rebuilds only the
# crate itself (the dependencies are most of a cold build).
# The workspace's other members (the bench, the test kit) are never built here, but cargo
# reads their manifests, so those come in with empty placeholder sources.
COPY Cargo.toml Cargo.lock ./
COPY bench/Cargo.toml bench/Cargo.toml
COPY testkit/Cargo.toml testkit/Cargo.toml
RUN mkdir -p src bench/src testkit/src \
    && echo 'fn main() {}' >src/main.rs \
    && : >src/lib.rs \
    && echo 'fn main() {}' >bench/src/main.rs \
    && : >testkit/src/lib.rs \
    && cargo build --release --locked -p redisched --bin redisched \
    && rm -rf src
COPY . .
# COPY keeps the sources' modification times, which may be older than the placeholders':
# touch them so cargo rebuilds the crate instead of shipping the placeholder.
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked -p redisched --bin redisched \
    && cp target/release/redisched /usr/local/bin/redisched

FROM debian:bookworm-slim
# curl serves the container healthcheck (GET /readyz).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home redisched
COPY --from=build /usr/local/bin/redisched /usr/local/bin/redisched
USER redisched
# The admin API listens on 127.0.0.1:7171 unless REDISCHED_HTTP__LISTEN says otherwise;
# a non-loopback address also needs REDISCHED_HTTP__TOKEN (see docker-compose.yml).
EXPOSE 7171
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
    CMD curl -fsS http://127.0.0.1:7171/healthz || exit 1
ENTRYPOINT ["redisched"]
CMD ["run"]
