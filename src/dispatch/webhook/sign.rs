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

    /// The Standard Webhooks specification's known-answer vector (its reference
    /// libraries' `test_sign_function`): secret `whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw`,
    /// id `msg_p5jXN8AQM9LWM0D4loKWxJek`, timestamp 1614265330, body
    /// `{"test": 2432232314}`.
    const VECTOR_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const VECTOR_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const VECTOR_TIMESTAMP: u64 = 1_614_265_330;
    const VECTOR_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const VECTOR_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn the_standard_webhooks_known_answer_vector() {
        // The secret read as a target's configured secret is, `whsec_` and all.
        let key = crate::targets::secret_key(VECTOR_SECRET).expect("the spec's secret");
        let sig = signature(&[&key], VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY);
        assert_eq!(sig, VECTOR_SIGNATURE);
        // The spec's tests: one byte of the body, the id or the time changes it.
        for (id, timestamp, body) in [
            (
                "msg_p5jXN8AQM9LWM0D4loKWxJeK",
                VECTOR_TIMESTAMP,
                VECTOR_BODY,
            ),
            (VECTOR_ID, VECTOR_TIMESTAMP + 1, VECTOR_BODY),
            (VECTOR_ID, VECTOR_TIMESTAMP, &br#"{"test": 2432232315}"#[..]),
        ] {
            assert_ne!(signature(&[&key], id, timestamp, body), VECTOR_SIGNATURE);
        }
    }

    #[test]
    fn during_a_rotation_each_key_signs_and_the_vectors_signature_is_among_them() {
        let key = crate::targets::secret_key(VECTOR_SECRET).expect("the spec's secret");
        let other = crate::targets::secret_key("whsec_c2Vjb25kIHNlY3JldCBkdXJpbmcgcm90YXRpb24=")
            .expect("a second secret");
        let both = signature(&[&other, &key], VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY);
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2, "{both}");
        assert_eq!(parts[1], VECTOR_SIGNATURE, "in the order listed");
        assert_ne!(parts[0], VECTOR_SIGNATURE);
        assert!(parts[0].starts_with("v1,"));
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
