//! Loading: built-in defaults, then the TOML file, then the `REDISCHED_<SECTION>__<KEY>`
//! variables, merged by figment. Unknown names fail (`deny_unknown_fields` on every
//! section), except `REDISCHED_*` variables without the `__` shape, which are not
//! configuration (Kubernetes' service variables) and are only named in a warning.

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;

use super::{Config, ConfigError};

/// Every configuration variable is `REDISCHED_<SECTION>__<KEY>`.
pub const ENV_PREFIX: &str = "REDISCHED_";
const ENV_NESTING: &str = "__";

/// Whether a variable name, without [`ENV_PREFIX`], has the `<SECTION>__<KEY>` shape of a
/// configuration variable. Only those are configuration, and they are checked strictly
/// (`REDISCHED_REDIS__ULR` fails, naming the key).
fn is_config_shaped(name: &str) -> bool {
    name.contains(ENV_NESTING)
}

/// `REDISCHED_*` variables of `vars` that are not configuration because they lack the
/// `<SECTION>__<KEY>` shape, sorted. Kubernetes injects `REDISCHED_PORT`,
/// `REDISCHED_SERVICE_HOST`, `REDISCHED_PORT_7171_TCP_ADDR`, ... into every pod of a
/// namespace that has a Service named `redisched`; they must not stop the bridge, so the
/// loader skips them and the binary names them in one warning.
pub fn foreign_env_names(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut names: Vec<String> = names
        .into_iter()
        .filter(|name| {
            name.get(..ENV_PREFIX.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(ENV_PREFIX))
                && !is_config_shaped(&name[ENV_PREFIX.len()..])
        })
        .collect();
    names.sort();
    names
}

/// [`foreign_env_names`] of this process's environment.
pub fn foreign_env() -> Vec<String> {
    foreign_env_names(std::env::vars_os().map(|(name, _)| name.to_string_lossy().into_owned()))
}

impl Config {
    /// Defaults, then `file` if given, then the environment; validated.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::from_figment(Self::figment(file))
    }

    pub fn figment(file: Option<&Path>) -> Figment {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            figment = figment.merge(Toml::file_exact(path));
        }
        figment.merge(
            Env::prefixed(ENV_PREFIX)
                .filter(|key| is_config_shaped(key.as_str()))
                .split(ENV_NESTING),
        )
    }

    pub fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn env_overrides_file_overrides_defaults_and_bad_values_name_their_key() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[dispatch]\nttr_ms = 5000\nbatch = 10\n")?;
            jail.set_env("REDISCHED_DISPATCH__TTR_MS", "7000");
            jail.set_env("REDISCHED_REDIS__URL", "redis://127.0.0.1:6390/2");
            jail.set_env("REDISCHED_AMQP__URL", "amqp://u:p@h:5673/v");
            let config = Config::load(Some(Path::new("c.toml"))).expect("valid");
            assert_eq!(config.dispatch.ttr_ms, 7000);
            assert_eq!(config.dispatch.batch, 10);
            assert_eq!(config.redis.url, "redis://127.0.0.1:6390/2");
            assert_eq!(config.amqp.url, "amqp://u:p@h:5673/v");

            jail.set_env("REDISCHED_DISPATCH__TTR_MS", "5");
            let err = Config::load(None).expect_err("ttr too small");
            assert!(err.to_string().contains("dispatch.ttr_ms"), "{err}");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn kubernetes_service_variables_are_skipped_but_typos_in_a_section_still_fail() {
        figment::Jail::expect_with(|jail| {
            // What Kubernetes injects for a Service named `redisched` (port 7171, named `http`).
            let injected = [
                ("REDISCHED_PORT", "tcp://10.96.0.12:7171"),
                ("REDISCHED_SERVICE_HOST", "10.96.0.12"),
                ("REDISCHED_SERVICE_PORT", "7171"),
                ("REDISCHED_SERVICE_PORT_HTTP", "7171"),
                ("REDISCHED_PORT_7171_TCP", "tcp://10.96.0.12:7171"),
                ("REDISCHED_PORT_7171_TCP_ADDR", "10.96.0.12"),
                ("REDISCHED_PORT_7171_TCP_PORT", "7171"),
                ("REDISCHED_PORT_7171_TCP_PROTO", "tcp"),
            ];
            for (name, value) in injected {
                jail.set_env(name, value);
            }
            jail.set_env("REDISCHED_DISPATCH__TTR_MS", "7000");
            let config = Config::load(None).expect("service variables do not stop the loader");
            assert_eq!(config.dispatch.ttr_ms, 7000);

            let names = foreign_env_names(
                injected
                    .iter()
                    .map(|(name, _)| name.to_string())
                    .chain(["REDISCHED_DISPATCH__TTR_MS".into(), "PATH".into()]),
            );
            let mut expected: Vec<String> = injected.iter().map(|(n, _)| n.to_string()).collect();
            expected.sort();
            assert_eq!(names, expected);

            jail.set_env("REDISCHED_REDIS__ULR", "redis://127.0.0.1:6379");
            let err = Config::load(None).expect_err("a misspelled key in a known section");
            assert!(err.to_string().contains("ulr"), "{err}");
            Ok(())
        });
    }
}
