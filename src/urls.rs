//! URLs of the links (Redis, brokers, the OTLP receiver): the comma-separated list
//! `amqp.url` may hold, the OTLP endpoint's check, and redaction for logs and printed
//! configuration. Shared by config, the store, the AMQP
//! connector and the faces, so it belongs to none of them.

/// The broker URLs of `amqp.url`: one, or several separated by commas (tried in turn by
/// `amqp::connect`). A comma inside a password must be percent-encoded (`%2C`).
pub fn amqp_urls(raw: &str) -> Vec<&str> {
    raw.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// `amqp://user:secret@host/` -> `amqp://user:***@host/`, in each part of a
/// comma-separated list; any part that is not a URL with a host (unparsable, or a piece
/// of a password that contained a comma) is masked whole rather than risk printing a
/// secret.
pub fn redact_url(raw: &str) -> String {
    raw.split(',')
        .map(|part| match url::Url::parse(part.trim()) {
            Ok(mut url) if url.has_host() => {
                if url.password().is_some() {
                    // Setting a password only fails for URLs that cannot have one.
                    url.set_password(Some("***")).ok();
                }
                url.to_string()
            }
            _ => "***".into(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Why an OTLP/HTTP endpoint (`telemetry.otlp_endpoint`, `OTEL_EXPORTER_OTLP_ENDPOINT`)
/// cannot be used, if it cannot: an `http://` or `https://` URL with a host (https needs
/// the `tls` feature).
pub fn otlp_endpoint_problem(raw: &str) -> Option<String> {
    match url::Url::parse(raw.trim()) {
        Ok(url) if url.has_host() && url.scheme() == "http" => None,
        Ok(url) if url.has_host() && url.scheme() == "https" => (!cfg!(feature = "tls"))
            .then(|| "https:// needs a build with the `tls` feature".to_string()),
        _ => Some(format!(
            "expected an http:// or https:// URL of an OTLP/HTTP receiver (http://collector:4318), got {:?}",
            redact_url(raw)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_masks_passwords() {
        assert_eq!(
            redact_url("amqp://guest:secret@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(redact_url("redis://:pw@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(redact_url("not a url"), "***");
    }

    #[test]
    fn each_url_of_a_list_is_redacted() {
        let list = "amqp://guest:s1@h1:5672/%2f, amqp://u:s2@h2:5673/v,amqps://h3/%2f";
        assert_eq!(
            redact_url(list),
            "amqp://guest:***@h1:5672/%2f,amqp://u:***@h2:5673/v,amqps://h3/%2f"
        );
        // A password with a raw comma splits into pieces that are not URLs: all masked.
        let raw_comma = redact_url("amqp://u:se,cret@h:5672/%2f");
        assert!(
            !raw_comma.contains("se") && !raw_comma.contains("cret"),
            "{raw_comma}"
        );
        assert_eq!(amqp_urls(list).len(), 3);
    }
}
