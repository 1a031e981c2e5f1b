//! Why a command failed ([`CliError`]), its exit code, and how `--json` prints it; a
//! configuration error always names its key.

use serde_json::{json, Value};

use crate::config::ConfigError;
use crate::store::{Rejection, StoreError};

use super::exit;
use super::output::Output;

/// Why a command failed; each kind has its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("{}", describe_config_error(.0))]
    Config(#[from] ConfigError),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("refused by the store: {0}")]
    Refused(Rejection),
    #[error("{0}")]
    Failed(String),
    /// `check` found problems it did not repair; the report is printed as the error.
    #[error("{}", .0.human)]
    Problems(Box<Output>),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Config(_) => exit::USAGE,
            CliError::NotFound(_) => exit::NOT_FOUND,
            CliError::Unavailable(_) => exit::UNAVAILABLE,
            CliError::Refused(_) => exit::REFUSED,
            CliError::Failed(_) => exit::FAILED,
            CliError::Problems(_) => exit::PROBLEMS,
        }
    }

    /// The error as `--json` prints it.
    pub fn to_json(&self) -> Value {
        if let CliError::Problems(output) = self {
            let mut value = output.json.clone();
            value["error"] = json!("problems found and not repaired");
            value["kind"] = json!("problems");
            return value;
        }
        let kind = match self {
            CliError::Usage(_) => "usage",
            CliError::Config(_) => "config",
            CliError::NotFound(_) => "not_found",
            CliError::Unavailable(_) => "unavailable",
            CliError::Refused(_) => "refused",
            CliError::Failed(_) => "failed",
            CliError::Problems(_) => "problems",
        };
        let mut value = json!({ "error": self.to_string(), "kind": kind });
        match self {
            CliError::Config(err) => {
                if let Some(key) = config_key(err) {
                    value["key"] = json!(key);
                }
            }
            CliError::Refused(rejection) => value["code"] = json!(rejection.code.as_str()),
            _ => {}
        }
        value
    }
}

/// The dotted config key an error is about, when it is known.
pub fn config_key(err: &ConfigError) -> Option<String> {
    match err {
        ConfigError::Invalid { key, .. } => Some(key.clone()),
        ConfigError::Target { key, .. } => Some(key.clone()),
        ConfigError::Load(err) => Some(err.path.join(".")).filter(|k| !k.is_empty()),
    }
}

/// A config error that always names its key as `config key `a.b`: …`, also for values
/// of the wrong type (figment itself quotes the key as the env var spelled it).
pub fn describe_config_error(err: &ConfigError) -> String {
    match (err, config_key(err)) {
        (ConfigError::Load(inner), Some(key)) => format!("config key `{key}`: {inner}"),
        _ => err.to_string(),
    }
}

impl From<StoreError> for CliError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Unavailable(_) | StoreError::NotReplicated { .. } => {
                CliError::Unavailable(err.to_string())
            }
            StoreError::Rejected(rejection) => CliError::Refused(rejection),
            StoreError::BadReply { .. } => CliError::Failed(err.to_string()),
        }
    }
}
