//! A target's Standard Webhooks signing secrets: each a plain `"whsec_…"` string, or a
//! table `{ secret = "whsec_…", expires_at = "2027-01-01T00:00:00Z" }` whose secret
//! stops signing at that time, so a rotation needs no second deployment (add the new
//! secret, let consumers accept both, set `expires_at` on the old one).

use std::fmt;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::job::window::rfc3339_ms;

/// How long before its `expires_at` `check-config` starts warning about a secret.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(7 * 24 * 3600);

/// One entry of `signing_secrets`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum SigningSecret {
    /// `"whsec_…"`: signs for as long as it is listed.
    Plain(String),
    /// `{ secret = "whsec_…", expires_at = "<RFC 3339>" }`: signs until `expires_at`
    /// (a table without `expires_at` is a plain secret).
    Expiring {
        secret: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        expires_at: Option<String>,
    },
}

impl SigningSecret {
    /// The `whsec_…` text.
    pub fn secret(&self) -> &str {
        match self {
            Self::Plain(secret) | Self::Expiring { secret, .. } => secret,
        }
    }

    /// `expires_at` as written, if any.
    pub fn expires_at(&self) -> Option<&str> {
        match self {
            Self::Plain(_) => None,
            Self::Expiring { expires_at, .. } => expires_at.as_deref(),
        }
    }

    /// `expires_at` in epoch ms; `None` without one (or an unreadable one, which
    /// validation refuses).
    pub fn expires_at_ms(&self) -> Option<i64> {
        self.expires_at().and_then(|at| rfc3339_ms(at).ok())
    }

    /// Whether it signs at `now_ms`: it has no `expires_at`, or that lies after now.
    pub fn signs_at(&self, now_ms: i64) -> bool {
        self.expires_at_ms().is_none_or(|until| now_ms < until)
    }

    /// The same entry with the secret masked (`expires_at` is no secret).
    pub fn redacted(&self) -> Self {
        match self {
            Self::Plain(_) => Self::Plain("***".into()),
            Self::Expiring { expires_at, .. } => Self::Expiring {
                secret: "***".into(),
                expires_at: expires_at.clone(),
            },
        }
    }

    /// The checks of one entry: the message and the key's tail (``, `.secret`,
    /// `.expires_at`) of the first problem.
    pub(super) fn check(&self) -> Result<(), (&'static str, String)> {
        let field = match self {
            Self::Plain(_) => "",
            Self::Expiring { .. } => ".secret",
        };
        secret_key(self.secret()).map_err(|m| (field, m))?;
        if let Some(at) = self.expires_at() {
            rfc3339_ms(at).map_err(|why| {
                (
                    ".expires_at",
                    format!("{at:?} is not an RFC 3339 time such as 2027-01-01T00:00:00Z: {why}"),
                )
            })?;
        }
        Ok(())
    }
}

impl From<&str> for SigningSecret {
    fn from(secret: &str) -> Self {
        Self::Plain(secret.to_string())
    }
}

/// An entry reads as its `whsec_…` text, so [`secret_key`] takes it as it takes a string.
impl std::ops::Deref for SigningSecret {
    type Target = str;
    fn deref(&self) -> &str {
        self.secret()
    }
}

/// The HMAC key of a Standard Webhooks secret: the base64 after `whsec_`.
pub fn secret_key(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret
        .strip_prefix("whsec_")
        .ok_or("a Standard Webhooks secret starts with `whsec_`")?;
    match base64::engine::general_purpose::STANDARD.decode(b64) {
        Ok(key) if !key.is_empty() => Ok(key),
        _ => Err("the part after `whsec_` must be non-empty base64".into()),
    }
}

/// The table form, strictly: a misspelt key is named rather than taken for a string.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    secret: String,
    #[serde(default, deserialize_with = "time_text")]
    expires_at: Option<String>,
}

const EXPECTED: &str =
    "a signing secret: \"whsec_…\" or { secret = \"whsec_…\", expires_at = \"2027-01-01T00:00:00Z\" }";

impl<'de> Deserialize<'de> for SigningSecret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entry;
        impl<'de> Visitor<'de> for Entry {
            type Value = SigningSecret;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(SigningSecret::Plain(text.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let table = Table::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(SigningSecret::Expiring {
                    secret: table.secret,
                    expires_at: table.expires_at,
                })
            }
        }
        deserializer.deserialize_any(Entry)
    }
}

/// `expires_at` as text: a string, or a TOML date-time written without quotes (which
/// the TOML reader hands over as a one-entry table of its own).
fn time_text<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    struct Text;
    impl<'de> Visitor<'de> for Text {
        type Value = String;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an RFC 3339 time such as \"2027-01-01T00:00:00Z\"")
        }
        fn visit_str<E: de::Error>(self, text: &str) -> Result<String, E> {
            Ok(text.to_string())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<String, A::Error> {
            match map.next_entry::<String, String>()? {
                Some((key, text)) if key == "$__toml_private_datetime" => Ok(text),
                _ => Err(de::Error::invalid_type(de::Unexpected::Map, &self)),
            }
        }
    }
    deserializer.deserialize_any(Text).map(Some)
}

/// The HMAC keys of the secrets that sign at `at`, in the order listed: an expired
/// secret no longer signs. Entries validation would refuse are left out.
pub(super) fn keys_at(secrets: &[SigningSecret], at: SystemTime) -> Vec<Vec<u8>> {
    let now_ms = epoch_ms(at);
    secrets
        .iter()
        .filter(|s| s.signs_at(now_ms))
        .filter_map(|s| secret_key(s).ok())
        .collect()
}

pub(super) fn epoch_ms(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What `check-config` warns of for target `i` named `name` at `now`: each secret that
/// has expired or expires within [`EXPIRY_WARNING`], named by its key, and a target
/// whose secrets have all expired (its requests then go unsigned).
pub(super) fn expiry_warnings(
    i: usize,
    name: &str,
    secrets: &[SigningSecret],
    now: SystemTime,
) -> Vec<String> {
    let now_ms = epoch_ms(now);
    let soon_ms = i64::try_from(EXPIRY_WARNING.as_millis()).unwrap_or(i64::MAX);
    let mut warnings = Vec::new();
    for (j, secret) in secrets.iter().enumerate() {
        let (Some(at), Some(until)) = (secret.expires_at(), secret.expires_at_ms()) else {
            continue;
        };
        let key = format!("targets[{i}].signing_secrets[{j}]");
        // To the minute beyond an hour: the seconds of a week say nothing.
        let secs = u64::try_from((until - now_ms).abs() / 1000).unwrap_or(0);
        let secs = if secs >= 3600 { secs - secs % 60 } else { secs };
        let left = humantime::format_duration(Duration::from_secs(secs));
        if until <= now_ms {
            warnings.push(format!(
                "{key} of target {name} expired at {at} ({left} ago): it no longer signs; remove it once no consumer needs it"
            ));
        } else if until - now_ms <= soon_ms {
            warnings.push(format!(
                "{key} of target {name} expires at {at} (in {left}): it stops signing then; make sure its consumers accept another of the target's secrets"
            ));
        }
    }
    if !secrets.is_empty() && secrets.iter().all(|s| !s.signs_at(now_ms)) {
        warnings.push(format!(
            "every signing secret of target {name} (targets[{i}]) has expired: its requests go unsigned"
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::targets::{validate, TargetConfig};
    use figment::providers::{Format, Toml};

    const A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const B: &str = "whsec_c2Vjb25kIHNlY3JldCBkdXJpbmcgcm90YXRpb24=";

    fn at(rfc3339: &str) -> SystemTime {
        let ms = rfc3339_ms(rfc3339).expect("a time");
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms as u64)
    }

    /// `[[targets]]` with `signing_secrets = <secrets>` through the real loader.
    fn load(secrets: &str) -> Result<Config, String> {
        let file = format!(
            "[[targets]]\nname = \"billing\"\ntopics = [\"billing.#\"]\nurl = \"http://127.0.0.1:9191/receive\"\nsigning_secrets = {secrets}\n"
        );
        let figment = Config::figment(None).merge(Toml::string(&file));
        Config::from_figment(figment).map_err(|e| e.to_string())
    }

    #[test]
    fn plain_strings_and_tables_load_side_by_side() {
        let config = load(&format!(
            "[\"{A}\", {{ secret = \"{B}\", expires_at = \"2027-01-01T00:00:00Z\" }}, {{ secret = \"{A}\", expires_at = 2028-06-01T12:00:00+02:00 }}, {{ secret = \"{B}\" }}]"
        ))
        .expect("loads");
        assert_eq!(
            config.targets[0].signing_secrets,
            [
                SigningSecret::Plain(A.into()),
                SigningSecret::Expiring {
                    secret: B.into(),
                    expires_at: Some("2027-01-01T00:00:00Z".into())
                },
                // Unquoted, TOML's own date-time: the same text.
                SigningSecret::Expiring {
                    secret: A.into(),
                    expires_at: Some("2028-06-01T12:00:00+02:00".into())
                },
                SigningSecret::Expiring {
                    secret: B.into(),
                    expires_at: None
                },
            ]
        );
        assert_eq!(
            config.targets[0].signing_secrets[2].expires_at_ms(),
            rfc3339_ms("2028-06-01T10:00:00Z").ok()
        );
        // Plain strings alone load as before.
        let config = load(&format!("[\"{A}\", \"{B}\"]")).expect("loads");
        assert_eq!(config.targets[0].signing_secrets, [A.into(), B.into()]);
    }

    #[test]
    fn a_bad_entry_is_named_by_its_key() {
        let err = load(&format!(
            "[\"{A}\", {{ secret = \"{B}\", expires_at = \"next spring\" }}]"
        ))
        .unwrap_err();
        assert!(
            err.starts_with("config key `targets[0].signing_secrets[1].expires_at`: \"next spring\" is not an RFC 3339 time"),
            "{err}"
        );
        let err =
            load("[{ secret = \"nope\", expires_at = \"2027-01-01T00:00:00Z\" }]").unwrap_err();
        assert!(
            err.starts_with("config key `targets[0].signing_secrets[0].secret`: a Standard Webhooks secret starts with `whsec_`"),
            "{err}"
        );
        let err = load("[\"nope\"]").unwrap_err();
        assert!(
            err.starts_with("config key `targets[0].signing_secrets[0]`: "),
            "{err}"
        );
        // A misspelt key of the table, and a value of the wrong type, as the loader says them.
        let err = load(&format!(
            "[{{ secret = \"{A}\", expire_at = \"2027-01-01T00:00:00Z\" }}]"
        ))
        .unwrap_err();
        assert!(err.contains("unknown field: found `expire_at`"), "{err}");
        assert!(
            err.contains("targets.0.signing_secrets.0.expire_at"),
            "names where: {err}"
        );
        let err = load("[5]").unwrap_err();
        assert!(err.contains("a signing secret"), "{err}");
    }

    #[test]
    fn an_expired_secret_no_longer_signs() {
        let target = TargetConfig {
            signing_secrets: vec![
                SigningSecret::Expiring {
                    secret: A.into(),
                    expires_at: Some("2027-01-01T00:00:00Z".into()),
                },
                B.into(),
            ],
            ..TargetConfig::default()
        };
        let (a, b) = (secret_key(A).unwrap(), secret_key(B).unwrap());
        assert_eq!(
            target.signing_keys_at(at("2026-12-31T23:59:59.999Z")),
            [a.clone(), b.clone()],
            "both sign before"
        );
        assert_eq!(
            target.signing_keys_at(at("2027-01-01T00:00:00Z")),
            std::slice::from_ref(&b),
            "it expires at its time"
        );
        assert_eq!(target.signing_keys_at(at("2030-01-01T00:00:00Z")), [b]);
        let only_old = TargetConfig {
            signing_secrets: target.signing_secrets[..1].to_vec(),
            ..TargetConfig::default()
        };
        assert!(only_old
            .signing_keys_at(at("2027-01-02T00:00:00Z"))
            .is_empty());
    }

    #[test]
    fn check_config_warns_of_expired_and_soon_expiring_secrets() {
        let secrets = vec![
            A.into(),
            SigningSecret::Expiring {
                secret: B.into(),
                expires_at: Some("2027-01-01T00:00:00Z".into()),
            },
            SigningSecret::Expiring {
                secret: A.into(),
                expires_at: Some("2027-01-10T00:00:00Z".into()),
            },
        ];
        let target = |name: &str| TargetConfig {
            name: name.into(),
            signing_secrets: secrets.clone(),
            ..TargetConfig::default()
        };
        let targets = [TargetConfig::default(), target("billing")];
        let warnings = |now: &str| crate::targets::secret_warnings(&targets, at(now));
        assert!(warnings("2026-12-01T00:00:00Z").is_empty(), "a month ahead");
        assert_eq!(
            warnings("2026-12-30T00:00:00Z"),
            ["targets[1].signing_secrets[1] of target billing expires at 2027-01-01T00:00:00Z (in 2days): it stops signing then; make sure its consumers accept another of the target's secrets"]
        );
        assert_eq!(
            warnings("2027-01-05T12:00:00Z"),
            [
                "targets[1].signing_secrets[1] of target billing expired at 2027-01-01T00:00:00Z (4days 12h ago): it no longer signs; remove it once no consumer needs it",
                "targets[1].signing_secrets[2] of target billing expires at 2027-01-10T00:00:00Z (in 4days 12h): it stops signing then; make sure its consumers accept another of the target's secrets",
            ]
        );
        // Every secret expired: said once more for the target.
        let all_expiring = [TargetConfig {
            name: "mail".into(),
            signing_secrets: secrets[1..].to_vec(),
            ..TargetConfig::default()
        }];
        let said = crate::targets::secret_warnings(&all_expiring, at("2027-02-01T00:00:00Z"));
        assert_eq!(said.len(), 3, "{said:?}");
        assert_eq!(
            said[2],
            "every signing secret of target mail (targets[0]) has expired: its requests go unsigned"
        );
    }

    #[test]
    fn redaction_masks_table_secrets_and_keeps_their_expiry() {
        let mut target = TargetConfig {
            signing_secrets: vec![
                A.into(),
                SigningSecret::Expiring {
                    secret: B.into(),
                    expires_at: Some("2027-01-01T00:00:00Z".into()),
                },
            ],
            ..TargetConfig::default()
        };
        target.redact();
        assert_eq!(
            target.signing_secrets,
            [
                SigningSecret::Plain("***".into()),
                SigningSecret::Expiring {
                    secret: "***".into(),
                    expires_at: Some("2027-01-01T00:00:00Z".into())
                }
            ]
        );
        // What check-config prints loads again (TOML, a mixed array).
        #[derive(Serialize)]
        struct File<'a> {
            targets: &'a [TargetConfig],
        }
        let printed = toml::to_string_pretty(&File {
            targets: std::slice::from_ref(&target),
        })
        .unwrap();
        assert!(!printed.contains(B) && !printed.contains(A), "{printed}");
        assert!(printed.contains("2027-01-01T00:00:00Z"), "{printed}");
        #[derive(Deserialize)]
        struct Back {
            targets: Vec<TargetConfig>,
        }
        let back: Back = toml::from_str(&printed).expect("reads back");
        assert_eq!(back.targets[0].signing_secrets, target.signing_secrets);
    }

    #[test]
    fn validation_accepts_every_form_and_names_the_bad_one() {
        let mut t = TargetConfig {
            name: "a".into(),
            topics: vec!["x".into()],
            url: "http://127.0.0.1:9191/receive".into(),
            signing_secrets: vec![
                A.into(),
                SigningSecret::Expiring {
                    secret: B.into(),
                    expires_at: Some("2020-01-01T00:00:00Z".into()),
                },
            ],
            ..TargetConfig::default()
        };
        assert_eq!(
            validate(std::slice::from_ref(&t), 30_000),
            Ok(()),
            "an expired secret is no error"
        );
        t.signing_secrets.push(SigningSecret::Expiring {
            secret: A.into(),
            expires_at: Some("1969-12-31T00:00:00Z".into()),
        });
        let err = validate(&[t], 30_000).unwrap_err();
        assert_eq!(err.key, "targets[0].signing_secrets[2].expires_at");
        assert!(err.message.contains("before 1970"), "{}", err.message);
    }
}
