//! TLS on both links: `amqps://` to RabbitMQ and `rediss://` to Redis.
//!
//! Built with the `tls` cargo feature (on by default): rustls on the *ring* provider.
//! The server's certificate is checked against the system's root certificates and,
//! if `amqp.tls_ca_file` / `redis.tls_ca_file` names a PEM file, against the CAs in it
//! too (for a private CA or a self-signed certificate). A certificate no trusted CA
//! signed, or one for another host name, fails the connection: there is no fallback to
//! plaintext and no "insecure" mode. A build without the feature refuses TLS URLs at
//! the config check instead of connecting in plaintext.

use std::path::Path;

use crate::config::{Config, ConfigError};

/// Whether this build can speak TLS.
pub const ENABLED: bool = cfg!(feature = "tls");

const PEM_CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----";

/// `Some(path)` for a non-empty config value.
pub fn ca_file(value: &str) -> Option<&Path> {
    (!value.is_empty()).then(|| Path::new(value))
}

/// The TLS part of the config check: TLS URLs need the feature, a CA file needs a TLS
/// URL to apply to (a CA file next to a plaintext URL would look protected and not
/// be), and it must hold at least one PEM certificate.
pub fn validate(config: &Config) -> Result<(), ConfigError> {
    let redis_tls = config.redis.url.starts_with("rediss://");
    let amqp_tls = config
        .amqp
        .url
        .split(',')
        .any(|u| u.trim().starts_with("amqps://"));
    for (key, tls, scheme) in [
        ("redis.url", redis_tls, "rediss://"),
        ("amqp.url", amqp_tls, "amqps://"),
    ] {
        if tls && !ENABLED {
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
            &config.redis.tls_ca_file,
            redis_tls,
            "rediss://",
        ),
        (
            "amqp.tls_ca_file",
            &config.amqp.tls_ca_file,
            amqp_tls,
            "amqps://",
        ),
    ] {
        let Some(path) = ca_file(file) else { continue };
        if !tls {
            return Err(invalid(
                key,
                format!("only used with a {scheme} URL: use one, or leave this key empty"),
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
        if !text.contains(PEM_CERTIFICATE) {
            return Err(invalid(
                key,
                format!("{} holds no PEM certificate", path.display()),
            ));
        }
    }
    Ok(())
}

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.into(),
    }
}

/// A Redis client for `url`; with `ca_file` (a `rediss://` URL), one that also trusts
/// the CAs in that file. The file is read on every call, so each reconnect sees a
/// rotated CA.
pub fn redis_client(url: &str, ca_file: Option<&Path>) -> redis::RedisResult<redis::Client> {
    match ca_file {
        None => redis::Client::open(url),
        Some(path) => redis_client_with_ca(url, path),
    }
}

#[cfg(feature = "tls")]
fn redis_client_with_ca(url: &str, path: &Path) -> redis::RedisResult<redis::Client> {
    let ca = std::fs::read(path).map_err(|e| {
        redis::RedisError::from(std::io::Error::other(format!(
            "cannot read redis.tls_ca_file {}: {e}",
            path.display()
        )))
    })?;
    // The redis crate uses a given root certificate *instead of* the system roots;
    // both are trusted here, as on the AMQP side.
    let mut roots = system_roots_pem();
    roots.extend_from_slice(&ca);
    redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(roots),
        },
    )
}

#[cfg(not(feature = "tls"))]
fn redis_client_with_ca(_url: &str, _path: &Path) -> redis::RedisResult<redis::Client> {
    Err(redis::RedisError::from(std::io::Error::other(
        "redis.tls_ca_file needs TLS, and this build has none (built without the `tls` feature)",
    )))
}

/// The system's root certificates as PEM (unreadable ones are skipped).
#[cfg(feature = "tls")]
fn system_roots_pem() -> Vec<u8> {
    use base64::Engine as _;
    let mut pem = String::new();
    for cert in rustls_native_certs::load_native_certs().certs {
        let b64 = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
        pem.push_str(PEM_CERTIFICATE);
        pem.push('\n');
        for line in b64.as_bytes().chunks(64) {
            pem.push_str(std::str::from_utf8(line).unwrap_or_default());
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem.into_bytes()
}

/// The TLS settings of an AMQP connection: the system roots (lapin's default) plus the
/// CAs of `ca_file`, if given.
pub fn amqp_tls_config(ca_file: Option<&Path>) -> std::io::Result<lapin::tcp::OwnedTLSConfig> {
    let cert_chain = match ca_file {
        None => None,
        Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
            std::io::Error::other(format!(
                "cannot read amqp.tls_ca_file {}: {e}",
                path.display()
            ))
        })?),
    };
    Ok(lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_needs_a_tls_url_and_a_certificate() {
        let dir = std::env::temp_dir().join(format!("redisched-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pem = dir.join("ca.pem");
        std::fs::write(
            &pem,
            format!("{PEM_CERTIFICATE}\nAAAA\n-----END CERTIFICATE-----\n"),
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
        if ENABLED {
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
        let _ = std::fs::remove_dir_all(&dir);
    }
}
