//! What every webhook request says besides its job: who is calling (`User-Agent:
//! redisched/<version>`, unless the target's `headers` name another), and which of the
//! target's signing secrets sign it (one past its `expires_at` no longer does). Real
//! bridge, real receiver; the signatures recomputed here from the secrets, and checked by
//! the PyPI `standardwebhooks` and `svix` and the npm `standardwebhooks` libraries.

use crate::common;

use std::time::Duration;

use base64::Engine as _;
use common::bridge::*;
use common::receiver::{Receiver, Recorded};
use common::verifiers;
use hmac::{Hmac, Mac};
use redisched::config::Config;
use redisched::targets::{secret_key, SigningSecret, TargetConfig};
use sha2::Sha256;

const SECOND: Duration = Duration::from_secs(1);
const SECRET_A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SECRET_B: &str = "whsec_c2Vjb25kIHNlY3JldCBkdXJpbmcgcm90YXRpb24=";

fn target(name: &str, topic: &str, url: String) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: vec![topic.into()],
        url,
        timeout_ms: 2_000,
        ..TargetConfig::default()
    }
}

fn config_with(label: &str, targets: Vec<TargetConfig>) -> Config {
    let mut config = test_config(label);
    config.targets = targets;
    config.validate().expect("valid test config");
    config
}

/// `v1,<base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}">` for `secret`.
fn signature_by(secret: &str, request: &Recorded) -> String {
    let key = secret_key(secret).expect("a whsec_ secret");
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("any key length");
    let id = request.header("webhook-id").expect("webhook-id");
    let timestamp = request
        .header("webhook-timestamp")
        .expect("webhook-timestamp");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(&request.body);
    let b64 = base64::engine::general_purpose::STANDARD;
    format!("v1,{}", b64.encode(mac.finalize().into_bytes()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_says_who_is_calling_unless_the_target_names_another() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let plain = target("plain", "ua.plain", receiver.url("/plain"));
    let mut own = target("own", "ua.own", receiver.url("/own"));
    own.headers
        .insert("User-Agent".into(), "billing-relay/2".into());
    let config = config_with("hookua", vec![plain, own]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);

    broker.put("ua.plain", "j1", b"one", &[]).await;
    broker.put("ua.own", "j2", b"two", &[]).await;
    let got = receiver.wait_for(2, 10 * SECOND).await;
    assert_eq!(got.len(), 2, "both delivered");
    let agent = |path: &str| {
        let request = got.iter().find(|r| r.path == path).expect("its request");
        request
            .headers
            .get_all("user-agent")
            .iter()
            .map(|v| v.to_str().unwrap_or("").to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        agent("/plain"),
        [format!("redisched/{}", env!("CARGO_PKG_VERSION"))]
    );
    assert_eq!(
        agent("/own"),
        ["billing-relay/2"],
        "the target's own header replaces it, never beside it"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_past_its_expires_at_no_longer_signs() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut hook = target("rotating", "rotating", receiver.url("/r"));
    hook.signing_secrets = vec![
        SigningSecret::Expiring {
            secret: SECRET_A.into(),
            expires_at: Some("2020-01-01T00:00:00Z".into()),
        },
        SigningSecret::Expiring {
            secret: SECRET_B.into(),
            expires_at: Some("2999-01-01T00:00:00Z".into()),
        },
    ];
    let config = config_with("hookexp", vec![hook]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);

    broker.put("rotating", "j1", br#"{"n":1}"#, &[]).await;
    let got = receiver.wait_for(1, 10 * SECOND).await;
    assert_eq!(got.len(), 1, "delivered");
    let signature = got[0].header("webhook-signature").expect("signed");
    assert_eq!(
        signature,
        signature_by(SECRET_B, &got[0]),
        "only the secret not yet expired signs"
    );
    assert_ne!(
        signature,
        signature_by(SECRET_A, &got[0]),
        "the recomputation tells the two secrets apart"
    );
    // Libraries we did not write agree: the remaining secret verifies, the expired not.
    for verifier in verifiers::ALL {
        if let Err(out) = verifier.verify(&got[0], SECRET_B) {
            panic!(
                "{} refused the remaining secret's signature: {out}",
                verifier.name()
            );
        }
        assert!(
            verifier.verify(&got[0], SECRET_A).is_err(),
            "{} accepted the expired secret",
            verifier.name()
        );
    }
    bridge.stop().await;
    broker.cleanup().await;
}
