//! The configuration as `REDISCHED_*` variables, for a `redisched run` child process
//! (tests, benchmarks) started with a configuration built in code.

use super::Config;

impl Config {
    /// The `REDISCHED_*` environment that reproduces this configuration, every key
    /// (`REDISCHED_DISPATCH__TTR_MS=30000`): how tests and benchmarks start a
    /// `redisched run` child with a configuration built in code.
    pub fn to_env(&self) -> Vec<(String, String)> {
        let mut vars = Vec::new();
        if let Ok(serde_json::Value::Object(sections)) = serde_json::to_value(self) {
            for (section, keys) in sections {
                let serde_json::Value::Object(keys) = keys else {
                    continue;
                };
                for (key, value) in keys {
                    let value = match value {
                        serde_json::Value::String(text) => text,
                        other => other.to_string(),
                    };
                    let name = format!("REDISCHED_{}__{}", section, key).to_uppercase();
                    vars.push((name, value));
                }
            }
        }
        vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn to_env_reproduces_the_configuration_through_the_loader() {
        let mut config = Config::default();
        config.redis.prefix = "p-1".into();
        config.amqp.url = "amqp://u:p@h1:5672/%2f,amqp://u:p@h2:5672/%2f".into();
        config.dispatch.ttr_ms = 1234;
        config.http.enabled = false;
        config.log.level = "info,lapin=warn".into();
        figment::Jail::expect_with(|jail| {
            for (name, value) in config.to_env() {
                jail.set_env(name, value);
            }
            assert_eq!(Config::load(None).expect("loads"), config);
            Ok(())
        });
    }
}
