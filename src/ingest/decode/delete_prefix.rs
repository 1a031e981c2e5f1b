//! A `delete-prefix` (`x-redisched-op: delete-prefix`): the topic (routing key) and the
//! id prefix (`message_id`, or `x-redisched-id`). Applied on its own, between the
//! commands before and after it (`super::super::batch`).

use lapin::BasicProperties;

use super::put::refuse_unknown_headers;
use super::{invalid, Invalid, PREFIX_DELETE};
use crate::job::headers;
use crate::job::meta::{job_id, too_deep};
use crate::job::{IdPrefix, Topic};

/// A `delete-prefix` command: the topic and the id prefix, at least
/// [`crate::job::MIN_PREFIX_CHARS`] characters (there is no forcing over AMQP: a shorter
/// prefix is almost always a mistake, and the CLI and REST can force one).
pub(in crate::ingest) fn decode_prefix_delete(
    routing_key: &str,
    props: &BasicProperties,
) -> Result<(Topic, IdPrefix), Invalid> {
    if let Some(reason) = props.headers().as_ref().and_then(too_deep) {
        return Err(invalid(reason));
    }
    if let Some(table) = props.headers().as_ref() {
        refuse_unknown_headers(table)?;
    }
    let topic =
        Topic::new(routing_key).map_err(|e| invalid(format!("bad topic (routing key): {e}")))?;
    let raw = job_id(props).map_err(invalid)?.ok_or_else(|| {
        invalid(format!(
            "missing message_id (or header {}): a {PREFIX_DELETE} carries the id prefix there",
            headers::ID
        ))
    })?;
    let prefix = IdPrefix::new(raw, false).map_err(|e| invalid(e.to_string()))?;
    Ok((topic, prefix))
}

#[cfg(test)]
mod tests {
    use lapin::types::FieldTable;
    use lapin::BasicProperties;

    use super::super::fixtures::{props, s};
    use super::decode_prefix_delete;

    #[test]
    fn a_prefix_delete_names_a_topic_and_a_prefix_long_enough() {
        let op = || ("x-redisched-op", s("delete-prefix"));
        let one = props(&[op()]).with_message_id("order-".into());
        let (topic, prefix) = decode_prefix_delete("orders", &one).expect("valid");
        assert_eq!((topic.as_str(), prefix.as_str()), ("orders", "order-"));

        let short = props(&[op()]).with_message_id("or".into());
        let err = decode_prefix_delete("orders", &short).expect_err("too short");
        assert!(err.0.contains("shorter than 3"), "{err}");

        let mut table = FieldTable::default();
        table.insert("x-redisched-op".into(), s("delete-prefix"));
        let none = BasicProperties::default().with_headers(table);
        let err = decode_prefix_delete("orders", &none).expect_err("no prefix");
        assert!(
            err.0.contains("missing message_id") && err.0.contains("delete-prefix"),
            "{err}"
        );

        let unknown = props(&[
            op(),
            ("x-redisched-every", s("1m")),
            ("x-redisched-evry", s("1m")),
        ]);
        let err = decode_prefix_delete("orders", &unknown).expect_err("unknown header");
        assert!(err.0.contains("unknown header x-redisched-evry"), "{err}");
        let err = decode_prefix_delete("a{b}", &props(&[])).expect_err("bad topic");
        assert!(err.0.contains("bad topic (routing key)"), "{err}");
    }
}
