//! The check every loaded configuration passes ([`Config::validate`]): each rule names
//! the dotted key it is about (`dispatch.ttr_ms`, `policies[1].burst`), so a typo or a
//! value that cannot work fails at start.

use std::net::SocketAddr;

use crate::store::MAX_BATCH;
use crate::urls::amqp_urls;

use super::{
    Config, ConfigError, MAX_COMMAND_PARTITIONS, MAX_DISPATCH_CHANNELS, MAX_HTTP_CONNECTIONS,
    MAX_TELEMETRY_QUEUE, MAX_WAIT_REPLICAS,
};

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

impl Config {
    /// Checks every key; the first bad one is named in the error, in the schema's order
    /// (Redis, AMQP, limits, ingest and dispatch, HTTP, log, telemetry, policies, TLS,
    /// targets).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_redis()?;
        self.validate_amqp()?;
        self.validate_stages()?;
        self.validate_http()?;
        if !matches!(self.log.format.as_str(), "human" | "json") {
            return Err(invalid("log.format", "must be `human` or `json`"));
        }
        tracing_subscriber::EnvFilter::try_new(&self.log.level)
            .map_err(|e| invalid("log.level", e.to_string()))?;
        self.validate_telemetry()?;
        self.compiled_policies()?;
        self.validate_tls()?;
        crate::targets::validate(&self.targets, self.dispatch.ttr_ms).map_err(|e| {
            ConfigError::Target {
                key: e.key,
                message: e.message,
            }
        })
    }

    fn validate_redis(&self) -> Result<(), ConfigError> {
        let standalone_ok = |url: &str| {
            url::Url::parse(url)
                .ok()
                .is_some_and(|u| matches!(u.scheme(), "redis" | "rediss" | "redis+unix" | "unix"))
        };
        let redis_ok = match crate::store::cluster_seeds(&self.redis.url) {
            Some(seeds) => !seeds.is_empty() && seeds.iter().all(|s| standalone_ok(s)),
            None => standalone_ok(&self.redis.url),
        };
        if !redis_ok {
            return Err(invalid(
                "redis.url",
                "expected redis://host:port/db or redis-cluster://host:port,host:port",
            ));
        }
        if self.redis.prefix.is_empty() || self.redis.prefix.contains(['{', '}']) {
            return Err(invalid(
                "redis.prefix",
                "must be non-empty and free of braces",
            ));
        }
        self.validate_wait()
    }

    fn validate_amqp(&self) -> Result<(), ConfigError> {
        // One URL, or several (the nodes of a cluster) separated by commas: each must be
        // an amqp:// or amqps:// URL.
        let amqp_ok = |url: &str| {
            url::Url::parse(url)
                .ok()
                .is_some_and(|u| matches!(u.scheme(), "amqp" | "amqps"))
        };
        let amqp = amqp_urls(&self.amqp.url);
        if amqp.is_empty() || !amqp.iter().all(|u| amqp_ok(u)) {
            return Err(invalid(
                "amqp.url",
                "expected amqp://user:pass@host:port/vhost, or several separated by commas",
            ));
        }
        for (key, name) in [
            ("amqp.commands_exchange", &self.amqp.commands_exchange),
            ("amqp.commands_queue", &self.amqp.commands_queue),
            ("amqp.invalid_exchange", &self.amqp.invalid_exchange),
            ("amqp.invalid_queue", &self.amqp.invalid_queue),
            ("amqp.expired_exchange", &self.amqp.expired_exchange),
            ("amqp.expired_queue", &self.amqp.expired_queue),
            ("amqp.ready_exchange", &self.amqp.ready_exchange),
        ] {
            if name.is_empty() || name.len() > 255 {
                return Err(invalid(key, "must be 1..255 bytes"));
            }
        }
        if !(1..=MAX_COMMAND_PARTITIONS).contains(&self.amqp.command_partitions) {
            return Err(invalid(
                "amqp.command_partitions",
                format!("must be 1..={MAX_COMMAND_PARTITIONS} (1 = one commands queue)"),
            ));
        }
        if self.amqp.command_partitions > 1 && !self.amqp.single_active_consumer {
            return Err(invalid(
                "amqp.command_partitions",
                "partitions keep a job's commands in order only with amqp.single_active_consumer = true",
            ));
        }
        if self.amqp.reconnect_min_ms == 0
            || self.amqp.reconnect_max_ms < self.amqp.reconnect_min_ms
        {
            return Err(invalid(
                "amqp.reconnect_max_ms",
                "must be >= amqp.reconnect_min_ms > 0",
            ));
        }
        if self.amqp.heartbeat_secs == 0 {
            // 0 would negotiate no heartbeats at all: a half-open broker connection
            // (a cut the kernel never reports) would then hang a stage for good.
            return Err(invalid(
                "amqp.heartbeat_secs",
                "must be > 0: heartbeats are how a half-open broker connection is noticed",
            ));
        }
        Ok(())
    }

    /// `limits`, `ingest` and `dispatch`.
    fn validate_stages(&self) -> Result<(), ConfigError> {
        if self.limits.max_delay_ms <= 0 {
            return Err(invalid("limits.max_delay_ms", "must be > 0"));
        }
        if self.limits.max_body_bytes == 0 || self.limits.max_body_bytes > 512 << 20 {
            return Err(invalid("limits.max_body_bytes", "must be 1..=512 MiB"));
        }
        if self.limits.min_interval_ms == 0 {
            return Err(invalid("limits.min_interval_ms", "must be > 0"));
        }
        if self.ingest.prefetch == 0 {
            return Err(invalid("ingest.prefetch", "must be > 0"));
        }
        if !(1..=MAX_BATCH).contains(&self.ingest.batch) {
            return Err(invalid("ingest.batch", format!("must be 1..={MAX_BATCH}")));
        }
        if self.dispatch.ttr_ms < 100 {
            return Err(invalid("dispatch.ttr_ms", "must be >= 100"));
        }
        if !(1..=MAX_BATCH).contains(&self.dispatch.batch) {
            return Err(invalid(
                "dispatch.batch",
                format!("must be 1..={MAX_BATCH}"),
            ));
        }
        if self.dispatch.window == 0 {
            return Err(invalid("dispatch.window", "must be > 0"));
        }
        if !(1..=MAX_DISPATCH_CHANNELS).contains(&self.dispatch.channels) {
            return Err(invalid(
                "dispatch.channels",
                format!("must be 1..={MAX_DISPATCH_CHANNELS}"),
            ));
        }
        if self.dispatch.channels > self.dispatch.window {
            return Err(invalid(
                "dispatch.channels",
                "must not exceed dispatch.window (each channel needs room for a publish)",
            ));
        }
        if self.dispatch.retry_min_ms == 0
            || self.dispatch.retry_max_ms < self.dispatch.retry_min_ms
        {
            return Err(invalid(
                "dispatch.retry_max_ms",
                "must be >= dispatch.retry_min_ms > 0",
            ));
        }
        for (key, value) in [
            (
                "dispatch.requeue_interval_ms",
                self.dispatch.requeue_interval_ms,
            ),
            ("dispatch.poll_interval_ms", self.dispatch.poll_interval_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be > 0"));
            }
        }
        Ok(())
    }

    fn validate_http(&self) -> Result<(), ConfigError> {
        let listen: SocketAddr = self
            .http
            .listen
            .parse()
            .map_err(|e| invalid("http.listen", format!("expected ip:port ({e})")))?;
        if self.http.enabled
            && !listen.ip().is_loopback()
            && self.http.token.is_empty()
            && !self.http.allow_public_without_token
        {
            return Err(invalid(
                "http.listen",
                "a non-loopback address needs http.token (or http.allow_public_without_token = true)",
            ));
        }
        if !self.http.read_token.is_empty() && self.http.token.is_empty() {
            return Err(invalid(
                "http.read_token",
                "needs http.token: without it the API is open and a read-only token guards nothing",
            ));
        }
        if !self.http.read_token.is_empty() && self.http.read_token == self.http.token {
            return Err(invalid(
                "http.read_token",
                "must differ from http.token, or it would grant writes",
            ));
        }
        if self.http.header_read_timeout_ms == 0 {
            return Err(invalid("http.header_read_timeout_ms", "must be > 0"));
        }
        if !(1..=MAX_HTTP_CONNECTIONS).contains(&self.http.max_connections) {
            return Err(invalid(
                "http.max_connections",
                format!("must be 1..={MAX_HTTP_CONNECTIONS}"),
            ));
        }
        Ok(())
    }

    fn validate_telemetry(&self) -> Result<(), ConfigError> {
        let t = &self.telemetry;
        if !t.otlp_endpoint.is_empty() {
            crate::urls::otlp_endpoint_problem(&t.otlp_endpoint)
                .map_or(Ok(()), |e| Err(invalid("telemetry.otlp_endpoint", e)))?;
        }
        if !(0.0..=1.0).contains(&t.sampling_ratio) {
            return Err(invalid(
                "telemetry.sampling_ratio",
                "must be from 0 to 1 (the share of new traces recorded)",
            ));
        }
        if t.service_name.trim().is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty"));
        }
        if !(1..=MAX_TELEMETRY_QUEUE).contains(&t.max_queue_size) {
            return Err(invalid(
                "telemetry.max_queue_size",
                format!("must be 1..={MAX_TELEMETRY_QUEUE}"),
            ));
        }
        for (key, value) in [
            ("telemetry.batch_delay_ms", t.batch_delay_ms),
            ("telemetry.export_timeout_ms", t.export_timeout_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be > 0"));
            }
        }
        Ok(())
    }

    /// `[[policies]]` compiled (patterns parsed, limits checked); an error names the
    /// entry's key, e.g. `policies[1].max_per_second`.
    pub fn compiled_policies(&self) -> Result<crate::policy::Policies, ConfigError> {
        use crate::policy::{Policy, RateLimit, TopicPattern};
        let mut compiled = Vec::with_capacity(self.policies.len());
        for (i, policy) in self.policies.iter().enumerate() {
            if policy.topics.is_empty() {
                return Err(invalid(
                    format!("policies[{i}].topics"),
                    "must list at least one topic pattern (e.g. [\"mail.*\"])",
                ));
            }
            let topics = policy
                .topics
                .iter()
                .map(|p| TopicPattern::new(p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(format!("policies[{i}].topics"), e))?;
            let rate = match policy.max_per_second {
                None if policy.burst.is_some() => {
                    return Err(invalid(
                        format!("policies[{i}].burst"),
                        "needs max_per_second",
                    ))
                }
                None => None,
                Some(rate) => Some(RateLimit::new(rate, policy.burst).map_err(|e| {
                    let field = if e.0.starts_with("burst") {
                        "burst"
                    } else {
                        "max_per_second"
                    };
                    invalid(format!("policies[{i}].{field}"), e.0)
                })?),
            };
            let expires_after_ms = match policy.expires_after_ms {
                None => 0,
                Some(ms) => crate::policy::check_expires_after("expires_after_ms", i128::from(ms))
                    .map_err(|e| invalid(format!("policies[{i}].expires_after_ms"), e.0))?,
            };
            compiled.push(Policy {
                topics,
                rate,
                expires_after_ms,
            });
        }
        Ok(crate::policy::Policies(compiled))
    }

    /// `redis.wait_replicas` and `redis.wait_timeout_ms`.
    fn validate_wait(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        if redis.wait_replicas > MAX_WAIT_REPLICAS {
            return Err(invalid(
                "redis.wait_replicas",
                format!(
                    "must be 0..={MAX_WAIT_REPLICAS} (replicas that confirm each write; 0 = no waiting)"
                ),
            ));
        }
        if redis.wait_timeout_ms == 0 {
            return Err(invalid(
                "redis.wait_timeout_ms",
                "must be > 0 (Redis reads a WAIT timeout of 0 as \"wait forever\")",
            ));
        }
        // The WAIT travels in the same pipeline as the writes, under the response timeout:
        // a longer WAIT would be taken for a dead connection.
        if redis.wait_replicas > 0 && redis.wait_timeout_ms >= redis.response_timeout_ms {
            return Err(invalid(
                "redis.wait_timeout_ms",
                format!(
                    "must be below redis.response_timeout_ms ({} ms): a longer wait would count as a dead connection",
                    redis.response_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    /// The TLS part of the config check: TLS URLs need the feature, a CA file needs a TLS
    /// URL to apply to (a CA file next to a plaintext URL would look protected and not
    /// be), and it must hold at least one PEM certificate.
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let redis_tls = self.redis.url.starts_with("rediss://");
        let amqp_tls = self
            .amqp
            .url
            .split(',')
            .any(|u| u.trim().starts_with("amqps://"));
        for (key, tls, scheme) in [
            ("redis.url", redis_tls, "rediss://"),
            ("amqp.url", amqp_tls, "amqps://"),
        ] {
            if tls && !crate::tls::ENABLED {
                return Err(invalid(
                    key,
                    format!(
                        "{scheme} needs TLS, and this build has none (built without the `tls` feature)"
                    ),
                ));
            }
        }
        for (key, file, tls, scheme) in [
            (
                "redis.tls_ca_file",
                &self.redis.tls_ca_file,
                redis_tls,
                "rediss://",
            ),
            (
                "amqp.tls_ca_file",
                &self.amqp.tls_ca_file,
                amqp_tls,
                "amqps://",
            ),
        ] {
            let Some(path) = crate::tls::ca_file(file) else {
                continue;
            };
            if !tls {
                return Err(invalid(
                    key,
                    format!("only used with a {scheme} URL: use one, or leave this key empty"),
                ));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
            if !text.contains(crate::tls::PEM_CERTIFICATE) {
                return Err(invalid(
                    key,
                    format!("{} holds no PEM certificate", path.display()),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::store::Durability;

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn policies_load_from_the_file_and_bad_ones_name_their_key() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "p.toml",
                "[[policies]]\ntopics = [\"mail.*\"]\nmax_per_second = 0.5\n\n[[policies]]\ntopics = [\"#\"]\nmax_per_second = 200\nburst = 5\n",
            )?;
            let config = Config::load(Some(Path::new("p.toml"))).expect("valid");
            let policies = config.compiled_policies().expect("compiles");
            let t = |s| crate::job::Topic::new(s).unwrap();
            let rate = policies.rate_for(&t("mail.x")).expect("first");
            assert_eq!((rate.max_per_second, rate.burst), (0.5, 1));
            let rate = policies.rate_for(&t("sms")).expect("second");
            assert_eq!((rate.max_per_second, rate.burst), (200.0, 5));
            assert_eq!(policies.expires_after_for(&t("sms")), 0);
            jail.create_file(
                "e.toml",
                "[[policies]]\ntopics = [\"mail.#\"]\nexpires_after_ms = 60000\n",
            )?;
            let config = Config::load(Some(Path::new("e.toml"))).expect("valid");
            let policies = config.compiled_policies().expect("compiles");
            assert_eq!(policies.expires_after_for(&t("mail.x")), 60_000);
            assert_eq!(policies.rate_for(&t("mail.x")), None);
            for (body, key, needle) in [
                ("max_per_second = 0", "policies[0].max_per_second", "pause"),
                ("max_per_second = -2", "policies[0].max_per_second", "> 0"),
                (
                    "max_per_second = 1e12",
                    "policies[0].max_per_second",
                    "0.001..=",
                ),
                (
                    "max_per_second = 5\nburst = 0",
                    "policies[0].burst",
                    "whole number",
                ),
                (
                    "max_per_second = 5\nburst = 2.5",
                    "policies[0].burst",
                    "whole number",
                ),
                ("burst = 2", "policies[0].burst", "needs max_per_second"),
                (
                    "expires_after_ms = -1",
                    "policies[0].expires_after_ms",
                    ">= 0",
                ),
                ("expires_after_ms = \"soon\"", "expires_after_ms", ""),
            ] {
                jail.create_file(
                    "bad.toml",
                    &format!("[[policies]]\ntopics = [\"a\"]\n{body}\n"),
                )?;
                let err = Config::load(Some(Path::new("bad.toml"))).expect_err(body);
                assert!(
                    err.to_string().contains(key) && err.to_string().contains(needle),
                    "{body}: {err}"
                );
            }
            jail.create_file(
                "bad.toml",
                "[[policies]]\ntopics = [\"a.b*\"]\nmax_per_second = 1\n",
            )?;
            let err = Config::load(Some(Path::new("bad.toml"))).expect_err("pattern");
            assert!(err.to_string().contains("policies[0].topics"), "{err}");
            jail.create_file(
                "bad.toml",
                "[[policies]]\ntopics = [\"a\"]\nmax_per_second = \"fast\"\n",
            )?;
            let err = Config::load(Some(Path::new("bad.toml"))).expect_err("not a number");
            assert!(err.to_string().contains("max_per_second"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn heartbeats_cannot_be_turned_off() {
        let mut config = Config::default();
        config.amqp.heartbeat_secs = 0;
        let err = config.validate().expect_err("refused");
        assert!(err.to_string().contains("amqp.heartbeat_secs"), "{err}");
        assert!(err.to_string().contains("half-open"), "{err}");
    }

    #[test]
    fn command_partitions_are_1_to_256_and_need_a_single_active_consumer() {
        for bad in [0, MAX_COMMAND_PARTITIONS + 1] {
            let mut config = Config::default();
            config.amqp.command_partitions = bad;
            let err = config.validate().expect_err("refused");
            assert!(err.to_string().contains("amqp.command_partitions"), "{err}");
        }
        let mut config = Config::default();
        config.amqp.command_partitions = 8;
        assert!(config.validate().is_ok());
        config.amqp.single_active_consumer = false;
        let err = config.validate().expect_err("refused");
        assert!(err.to_string().contains("single_active_consumer"), "{err}");
        config.amqp.command_partitions = 1;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn dispatch_channels_are_1_to_16_and_no_more_than_the_window() {
        for (channels, window) in [(0, 1_000), (MAX_DISPATCH_CHANNELS + 1, 1_000), (4, 3)] {
            let mut config = Config::default();
            config.dispatch.channels = channels;
            config.dispatch.window = window;
            let err = config.validate().expect_err("refused");
            assert!(err.to_string().contains("dispatch.channels"), "{err}");
        }
        let mut config = Config::default();
        config.dispatch.channels = MAX_DISPATCH_CHANNELS;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn public_listen_without_token_is_refused() {
        let mut config = Config::default();
        config.http.listen = "0.0.0.0:7171".into();
        let err = config.validate().expect_err("refused");
        assert!(err.to_string().contains("http.listen"), "{err}");
        config.http.token = "t".into();
        config.validate().expect("a token makes it fine");
    }

    #[test]
    fn http_connection_limits_are_checked_in_user_terms() {
        for (key, set) in [
            (
                "http.header_read_timeout_ms",
                (|c: &mut Config| c.http.header_read_timeout_ms = 0) as fn(&mut Config),
            ),
            ("http.max_connections", |c: &mut Config| {
                c.http.max_connections = 0
            }),
            ("http.max_connections", |c: &mut Config| {
                c.http.max_connections = MAX_HTTP_CONNECTIONS + 1
            }),
        ] {
            let mut config = Config::default();
            set(&mut config);
            let err = config.validate().unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        assert!(Config::default().validate().is_ok());
    }

    #[test]
    fn wait_settings_are_checked_in_user_terms() {
        let mut config = Config::default();
        assert_eq!(config.durability(), None, "0 replicas: no waiting at all");
        config.redis.wait_replicas = 1;
        assert_eq!(
            config.durability(),
            Some(Durability {
                replicas: 1,
                timeout: Duration::from_secs(1)
            })
        );
        config.validate().expect("1 replica, 1 s");

        config.redis.wait_timeout_ms = 0;
        let err = config.validate().expect_err("0 would wait forever");
        assert!(
            err.to_string().contains("redis.wait_timeout_ms")
                && err.to_string().contains("forever"),
            "{err}"
        );
        config.redis.wait_timeout_ms = 5_000;
        let err = config
            .validate()
            .expect_err("as long as the response timeout");
        assert!(
            err.to_string()
                .contains("below redis.response_timeout_ms (5000 ms)"),
            "{err}"
        );
        config.redis.response_timeout_ms = 10_000;
        config
            .validate()
            .expect("a longer response timeout makes room");

        config.redis.wait_replicas = 100;
        let err = config.validate().expect_err("absurd replica count");
        assert!(
            err.to_string().contains("redis.wait_replicas") && err.to_string().contains("0..=16"),
            "{err}"
        );
        // Without waiting, the timeout only has to be a usable number.
        config.redis.wait_replicas = 0;
        config.redis.response_timeout_ms = 1_000;
        config
            .validate()
            .expect("unused timeout above the response timeout");
    }

    #[test]
    fn several_amqp_urls_are_validated() {
        let list = "amqp://guest:s1@h1:5672/%2f, amqp://u:s2@h2:5673/v,amqps://h3/%2f";
        let mut config = Config::default();
        config.amqp.url = list.into();
        config.validate().expect("a list of amqp URLs is valid");
        config.amqp.url = "amqp://h1/%2f,redis://h2".into();
        let err = config.validate().expect_err("every part must be amqp");
        assert!(err.to_string().contains("amqp.url"), "{err}");
        config.amqp.url = " , ".into();
        config.validate().expect_err("no URL at all");
    }

    #[test]
    fn a_ca_file_needs_a_tls_url_and_a_certificate() {
        let dir = std::env::temp_dir().join(format!("redisched-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pem = dir.join("ca.pem");
        std::fs::write(
            &pem,
            format!(
                "{}\nAAAA\n-----END CERTIFICATE-----\n",
                crate::tls::PEM_CERTIFICATE
            ),
        )
        .unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();

        let mut config = Config::default();
        config.validate().expect("defaults are valid");
        config.redis.tls_ca_file = pem.display().to_string();
        let err = config.validate().expect_err("redis:// with a CA file");
        assert!(err.to_string().contains("redis.tls_ca_file"), "{err}");
        config.redis.url = "rediss://127.0.0.1:6380/0".into();
        if crate::tls::ENABLED {
            config.validate().expect("rediss:// with a CA file");
        } else {
            let err = config.validate().expect_err("no TLS in this build");
            assert!(err.to_string().contains("redis.url"), "{err}");
            return;
        }
        config.redis.tls_ca_file = junk.display().to_string();
        let err = config.validate().expect_err("no certificate in it");
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
        config.redis.tls_ca_file = dir.join("missing.pem").display().to_string();
        let err = config.validate().expect_err("missing file");
        assert!(err.to_string().contains("cannot read"), "{err}");
        config.redis.tls_ca_file = String::new();

        config.amqp.tls_ca_file = pem.display().to_string();
        let err = config.validate().expect_err("amqp:// with a CA file");
        assert!(err.to_string().contains("amqp.tls_ca_file"), "{err}");
        config.amqp.url = "amqps://guest:guest@127.0.0.1:5671/%2f".into();
        config.validate().expect("amqps:// with a CA file");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn telemetry_is_off_by_default_set_by_its_variables_and_checked_by_key() {
        assert_eq!(Config::default().telemetry.otlp_endpoint, "");
        // REDISCHED_TELEMETRY__<KEY>: a valid set, then one bad value at a time.
        let valid = [
            ("OTLP_ENDPOINT", "http://collector:4318"),
            ("SAMPLING_RATIO", "0.25"),
            ("SERVICE_NAME", "redisched"),
            ("MAX_QUEUE_SIZE", "100"),
            ("BATCH_DELAY_MS", "5000"),
            ("EXPORT_TIMEOUT_MS", "10000"),
        ];
        let bad = [
            ("SAMPLING_RATIO", "1.5"),
            ("SAMPLING_RATIO", "-0.1"),
            ("OTLP_ENDPOINT", "collector:4318"),
            ("OTLP_ENDPOINT", "grpc://c:4317"),
            ("MAX_QUEUE_SIZE", "0"),
            ("SERVICE_NAME", " "),
            ("BATCH_DELAY_MS", "0"),
            ("EXPORT_TIMEOUT_MS", "0"),
        ];
        figment::Jail::expect_with(|jail| {
            let set = |jail: &mut figment::Jail, key: &str, value: &str| {
                jail.set_env(format!("REDISCHED_TELEMETRY__{key}"), value)
            };
            for (key, value) in valid {
                set(jail, key, value);
            }
            let config = Config::load(None).expect("valid");
            assert_eq!(config.telemetry.otlp_endpoint, "http://collector:4318");
            assert_eq!(config.telemetry.sampling_ratio, 0.25);
            assert_eq!(config.telemetry.max_queue_size, 100);
            for (key, value) in bad {
                set(jail, key, value);
                let err = Config::load(None).expect_err(value);
                let named = format!("telemetry.{}", key.to_lowercase());
                assert!(err.to_string().contains(&named), "{key}={value}: {err}");
                for (key, value) in valid {
                    set(jail, key, value);
                }
            }
            Ok(())
        });
    }

    #[test]
    fn a_printed_configuration_masks_the_otlp_password_and_shows_off_as_off() {
        let mut config = Config::default();
        assert_eq!(config.redacted().telemetry.otlp_endpoint, "");
        config.telemetry.otlp_endpoint = "https://u:secret@otlp.example".into();
        config.validate().expect("https");
        let shown = config.redacted().telemetry.otlp_endpoint;
        assert!(
            !shown.contains("secret") && shown.contains("otlp.example"),
            "{shown}"
        );
    }
}
