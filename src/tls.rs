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

/// Whether this build can speak TLS.
pub const ENABLED: bool = cfg!(feature = "tls");

pub(crate) const PEM_CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----";

/// `Some(path)` for a non-empty config value.
pub fn ca_file(value: &str) -> Option<&Path> {
    (!value.is_empty()).then(|| Path::new(value))
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

/// The rustls settings of webhook requests (*ring*): the system roots plus the CAs of
/// a target's `tls_ca_file`; HTTP/2 and HTTP/1.1 offered by ALPN.
#[cfg(feature = "tls")]
pub fn http_tls_config(ca_file: Option<&Path>) -> std::io::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot use is skipped, as the system's own
        // clients would; the others still make the store.
        roots.add(cert).ok();
    }
    if let Some(path) = ca_file {
        let pem = std::fs::read(path).map_err(|e| {
            std::io::Error::other(format!("cannot read tls_ca_file {}: {e}", path.display()))
        })?;
        use rustls::pki_types::pem::PemObject as _;
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
            let cert =
                cert.map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?;
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
