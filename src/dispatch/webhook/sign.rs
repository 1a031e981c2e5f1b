//! Standard Webhooks: the message id and the signature.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use lapin::protocol::basic::AMQPProperties;
use sha2::{Digest, Sha256};

/// `webhook-signature`: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, one per
/// key, space-separated (a consumer accepts any one: rotation).
pub(super) fn signature(keys: &[&[u8]], msg_id: &str, timestamp: u64, body: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    keys.iter()
        .filter_map(|key| {
            let mut mac = Hmac::<Sha256>::new_from_slice(key).ok()?;
            mac.update(msg_id.as_bytes());
            mac.update(b".");
            mac.update(timestamp.to_string().as_bytes());
            mac.update(b".");
            mac.update(body);
            Some(format!("v1,{}", b64.encode(mac.finalize().into_bytes())))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `webhook-id`: a digest of what makes one occurrence: topic, id, due time, stored
/// properties and body. Every retry of an occurrence carries the same one; the next
/// occurrence of a series (another due time) and a replace that changes the job's
/// body, headers or due time get another. Derived, so no record format changes and
/// every bridge computes the same id.
pub(super) fn webhook_id(
    topic: &str,
    id: &str,
    due_at: i64,
    body: &[u8],
    props: &AMQPProperties,
) -> String {
    let mut hash = Sha256::new();
    for part in [topic.as_bytes(), id.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.update(due_at.to_be_bytes());
    let meta = crate::job::meta::encode_meta(props);
    hash.update((meta.len() as u64).to_be_bytes());
    hash.update(&meta);
    hash.update(body);
    let digest = hash.finalize();
    format!(
        "msg_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..18])
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_webhooks_example_signature() {
        // From the Standard Webhooks specification's test vectors.
        let key = base64::engine::general_purpose::STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap();
        let sig = signature(
            &[&key],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn the_id_changes_with_the_occurrence_and_not_with_the_attempt() {
        let props = AMQPProperties::default();
        let a = webhook_id("t", "j", 1000, b"x", &props);
        assert_eq!(a, webhook_id("t", "j", 1000, b"x", &props));
        assert_ne!(a, webhook_id("t", "j", 2000, b"x", &props));
        assert_ne!(a, webhook_id("t", "j", 1000, b"y", &props));
        assert_ne!(a, webhook_id("t", "j2", 1000, b"x", &props));
    }
}
