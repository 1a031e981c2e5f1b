//! Property test of command decoding (`redisched::ingest::decode_parts`) with arbitrary
//! routing keys, properties, header types (every `AMQPValue` variant, nested), header
//! names including the control ones with arbitrary values, and bodies: it never panics,
//! and every input ends either as an `Op` that obeys the wire contract or as `Invalid`
//! with a reason (which becomes the `x-redisched-error` header of the set-aside copy).
//! No services needed.

use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use lapin::BasicProperties;
use proptest::prelude::*;
use redisched::ingest::{needs_clock, Invalid, Rules};
use redisched::job::meta::{decode_meta, encode_meta};
use redisched::job::{Due, PutMode};
use redisched::store::{Limits, Op};

/// `redisched::ingest::decode_parts` with `limits` (and the default minimum interval),
/// at a fixed server time: the op it yields, or why it is invalid.
fn decode_parts(
    key: &str,
    props: &BasicProperties,
    body: &[u8],
    limits: Limits,
) -> Result<Op, Invalid> {
    let rules = Rules {
        limits,
        min_interval_ms: 1000,
    };
    redisched::ingest::decode_parts(key, props, body, rules, Some(NOW)).map(|command| command.op)
}

/// The Redis server's clock as a batch read it: 2026-12-01T00:00:00Z.
const NOW: i64 = 1_796_083_200_000;

/// At most 255 bytes, cut at a char boundary (an AMQP short string).
fn short(s: String) -> ShortString {
    let mut cut = s.len().min(255);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    ShortString::from(s[..cut].to_string())
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        // Numbers, near-numbers and words a producer might really send.
        prop_oneof![
            Just("NaN".to_string()),
            Just("-NaN".to_string()),
            Just("inf".to_string()),
            Just("-Infinity".to_string()),
            Just("1e400".to_string()),
            Just(" 250 ".to_string()),
            Just("0x10".to_string()),
            Just("".to_string()),
            Just("put".to_string()),
            Just("replace".to_string()),
            Just("delete".to_string()),
            Just("DELETE".to_string()),
        ],
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|n| n.to_string()),
        "-?[0-9]{0,25}(\\.[0-9]{0,5})?([eE][-+]?[0-9]{1,3})?",
        any::<String>(),
        "[{}:a-z]{0,10}",
    ]
}

fn leaf() -> impl Strategy<Value = AMQPValue> {
    prop_oneof![
        any::<bool>().prop_map(AMQPValue::Boolean),
        any::<i8>().prop_map(AMQPValue::ShortShortInt),
        any::<u8>().prop_map(AMQPValue::ShortShortUInt),
        any::<i16>().prop_map(AMQPValue::ShortInt),
        any::<u16>().prop_map(AMQPValue::ShortUInt),
        any::<i32>().prop_map(AMQPValue::LongInt),
        any::<u32>().prop_map(AMQPValue::LongUInt),
        any::<i64>().prop_map(AMQPValue::LongLongInt),
        prop_oneof![
            any::<f32>(),
            Just(f32::NAN),
            Just(f32::INFINITY),
            Just(-0.0f32)
        ]
        .prop_map(AMQPValue::Float),
        prop_oneof![
            any::<f64>(),
            Just(f64::NAN),
            Just(f64::NEG_INFINITY),
            Just(1e300),
            Just(-1e300),
            Just(9.3e15)
        ]
        .prop_map(AMQPValue::Double),
        (any::<u8>(), any::<u32>())
            .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
        any_text().prop_map(|s| AMQPValue::ShortString(short(s))),
        any_text().prop_map(|s| AMQPValue::LongString(LongString::from(s))),
        proptest::collection::vec(any::<u8>(), 0..40)
            .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
        any::<u64>().prop_map(AMQPValue::Timestamp),
        proptest::collection::vec(any::<u8>(), 0..40)
            .prop_map(|b| AMQPValue::ByteArray(ByteArray::from(b))),
        Just(AMQPValue::Void),
    ]
}

fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => Just("x-delay".to_string()),
        3 => Just("x-deliver-at".to_string()),
        3 => Just("x-redisched-op".to_string()),
        1 => Just("x-redisched-error".to_string()),
        1 => Just("x-redisched-attempt".to_string()),
        2 => "[a-zA-Z-]{1,12}",
        1 => any::<String>(),
    ]
}

fn value() -> impl Strategy<Value = AMQPValue> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
            proptest::collection::vec((header_name(), inner), 0..4)
                .prop_map(|kv| AMQPValue::FieldTable(table(kv))),
        ]
    })
}

fn table(entries: Vec<(String, AMQPValue)>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in entries {
        table.insert(short(k), v);
    }
    table
}

fn routing_key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9._:/-]{1,30}",
        1 => "[a-z]{195,205}",
        1 => Just(String::new()),
        1 => "[a-z]{0,4}[{} #*]{1,2}[a-z]{0,4}",
        1 => any::<String>(),
    ]
}

fn message_id() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        4 => "[a-zA-Z0-9_-]{1,40}".prop_map(Some),
        1 => Just(None),
        1 => Just(Some(String::new())),
        1 => "[{}:]{1,5}".prop_map(Some),
        1 => "[a-z\u{e9}\u{1F600}]{250,260}".prop_map(Some),
        1 => any::<String>().prop_map(Some),
    ]
}

prop_compose! {
    fn properties()(
        id in message_id(),
        headers in proptest::option::of(proptest::collection::vec((header_name(), value()), 0..6)),
        content_type in proptest::option::of(any::<String>()),
        correlation_id in proptest::option::of("[a-z0-9]{0,10}"),
        reply_to in proptest::option::of("[a-z.]{0,10}"),
        expiration in proptest::option::of("[0-9]{0,6}"),
        priority in proptest::option::of(any::<u8>()),
        timestamp in proptest::option::of(any::<u64>()),
        delivery_mode in proptest::option::of(any::<u8>()),
        user_id in proptest::option::of("[a-z]{0,6}"),
    ) -> BasicProperties {
        let mut props = BasicProperties::default();
        if let Some(id) = id { props = props.with_message_id(short(id)); }
        if let Some(h) = headers { props = props.with_headers(table(h)); }
        if let Some(v) = content_type { props = props.with_content_type(short(v)); }
        if let Some(v) = correlation_id { props = props.with_correlation_id(short(v)); }
        if let Some(v) = reply_to { props = props.with_reply_to(short(v)); }
        if let Some(v) = expiration { props = props.with_expiration(short(v)); }
        if let Some(v) = priority { props = props.with_priority(v); }
        if let Some(v) = timestamp { props = props.with_timestamp(v); }
        if let Some(v) = delivery_mode { props = props.with_delivery_mode(v); }
        if let Some(v) = user_id { props = props.with_user_id(short(v)); }
        props
    }
}

prop_compose! {
    fn limits()(max_delay_ms in 0i64..400 * 86_400_000, max_body_bytes in 0usize..64) -> Limits {
        Limits { max_delay_ms, max_body_bytes }
    }
}

/// Whether these properties survive the AMQP codec, i.e. could arrive in a delivery.
fn on_the_wire(props: &BasicProperties) -> bool {
    decode_meta(&encode_meta(props)).is_ok()
}

fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(name)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn every_command_is_applied_or_refused_with_a_reason(
        key in routing_key(),
        props in properties(),
        body in proptest::collection::vec(any::<u8>(), 0..80),
        limits in limits(),
    ) {
        let _shared = crate::common::timed::shared_blocking();
        let decoded = std::panic::catch_unwind(|| decode_parts(&key, &props, &body, limits));
        let decoded = match decoded {
            Ok(decoded) => decoded,
            Err(_) => return Err(TestCaseError::fail("decode_parts panicked")),
        };
        match decoded {
            Err(invalid) => {
                prop_assert!(!invalid.0.trim().is_empty(), "an empty reason");
                // The reason becomes a header value: it must stay printable and short
                // enough not to bloat the set-aside copy.
                prop_assert!(invalid.0.len() < 1024, "reason of {} bytes", invalid.0.len());
            }
            Ok(op) => {
                // Whatever was accepted obeys the wire contract.
                prop_assert_eq!(op.topic().as_str(), key.as_str());
                let id = props.message_id().as_ref().map(|s| s.to_string());
                let op_header = header(&props, "x-redisched-op");
                match op {
                    Op::Delete { id: job, .. } => {
                        prop_assert_eq!(Some(job.as_str().to_string()), id);
                        prop_assert!(op_header.is_some());
                    }
                    Op::Put(put) => {
                        prop_assert_eq!(Some(put.id.as_str().to_string()), id);
                        prop_assert_eq!(&put.body, &body);
                        prop_assert!(put.body.len() <= limits.max_body_bytes);
                        let delay = header(&props, "x-delay");
                        let at = header(&props, "x-deliver-at");
                        prop_assert!(delay.is_none() || at.is_none(), "both headers accepted");
                        match put.due {
                            Due::Delay(ms) => {
                                prop_assert!((0..=limits.max_delay_ms).contains(&ms), "delay {}", ms);
                                prop_assert!(at.is_none());
                            }
                            Due::At(_) => prop_assert!(at.is_some()),
                        }
                        if put.mode == PutMode::Replace {
                            prop_assert!(op_header.is_some());
                        }
                        // The stored meta reads back (for every input the wire can
                        // carry: a ShortString *value* has no AMQP type tag, lapin never
                        // parses one and the broker refuses one, so inputs holding one
                        // cannot reach the bridge), and the control headers and the
                        // properties that must not be forwarded are not in it.
                        let meta = match decode_meta(&put.meta) {
                            Ok(meta) => meta,
                            Err(_) if !on_the_wire(&props) => return Ok(()),
                            Err(e) => return Err(TestCaseError::fail(format!("meta unreadable: {e}"))),
                        };
                        prop_assert_eq!(encode_meta(&meta), put.meta.clone());
                        prop_assert!(meta.message_id().is_none() && meta.reply_to().is_none());
                        prop_assert!(meta.expiration().is_none() && meta.user_id().is_none());
                        if let Some(headers) = meta.headers() {
                            for control in ["x-deliver-at", "x-redisched-op", "x-redisched-id"] {
                                prop_assert!(!headers.inner().contains_key(control));
                            }
                            // x-delay comes back only as the delayed-message plugin
                            // delivers it: minus the requested delay, never positive.
                            if let Some(delay) = headers.inner().get("x-delay") {
                                let asked = props
                                    .headers()
                                    .as_ref()
                                    .is_some_and(|h| h.inner().contains_key("x-delay"));
                                prop_assert!(asked, "x-delay delivered though none was asked");
                                let negated = match delay {
                                    AMQPValue::LongInt(v) => i64::from(*v),
                                    AMQPValue::LongLongInt(v) => *v,
                                    other => return Err(TestCaseError::fail(format!("x-delay delivered as {other:?}"))),
                                };
                                prop_assert!(negated <= 0, "x-delay delivered as {negated}");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A delay header is never silently turned into "now" or truncated: an accepted put
/// has exactly the delay it asked for (rounded up to a whole ms), or it is refused.
#[test]
fn delays_are_exact_or_refused() {
    let _shared = crate::common::timed::shared_blocking();
    let limits = Limits {
        max_delay_ms: 1_000_000,
        max_body_bytes: 10,
    };
    let cases: Vec<(AMQPValue, Option<i64>)> = vec![
        (AMQPValue::LongString("12.0001".into()), Some(13)),
        (AMQPValue::LongString("1000000".into()), Some(1_000_000)),
        (AMQPValue::LongString("1000001".into()), None),
        (AMQPValue::LongString("1e6".into()), Some(1_000_000)),
        (AMQPValue::LongString("1e7".into()), None),
        (AMQPValue::LongString("-5".into()), Some(0)),
        (AMQPValue::LongString("NaN".into()), None),
        (AMQPValue::LongString("".into()), None),
        (AMQPValue::Double(f64::INFINITY), None),
        (AMQPValue::Double(-1e300), None),
        (AMQPValue::Float(999_999.5), Some(1_000_000)),
        (AMQPValue::LongUInt(u32::MAX), None),
        (AMQPValue::Timestamp(5), None),
        (
            AMQPValue::DecimalValue(DecimalValue { scale: 0, value: 5 }),
            None,
        ),
        (
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongInt(5)])),
            None,
        ),
    ];
    for (value, expected) in cases {
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), value.clone());
        let props = BasicProperties::default()
            .with_message_id("j".into())
            .with_headers(headers);
        let got = decode_parts("t", &props, b"", limits);
        match (got, expected) {
            (Ok(Op::Put(put)), Some(ms)) => assert_eq!(put.due, Due::Delay(ms), "{value:?}"),
            (Err(invalid), None) => {
                assert!(invalid.0.contains("x-delay"), "{invalid} for {value:?}")
            }
            (other, expected) => panic!("{value:?}: got {other:?}, expected {expected:?}"),
        }
    }
}

/// A header value nesting `depth` tables or arrays (built iteratively), `width` siblings
/// at the top.
fn nested(depth: usize, arrays: bool, width: usize) -> FieldTable {
    let mut value = AMQPValue::LongString("leaf".into());
    for _ in 0..depth {
        value = if arrays {
            AMQPValue::FieldArray(FieldArray::from(vec![value]))
        } else {
            let mut t = FieldTable::default();
            t.insert("a".into(), value);
            AMQPValue::FieldTable(t)
        };
    }
    let mut headers = FieldTable::default();
    for i in 0..width {
        headers.insert(short(format!("w{i}")), AMQPValue::LongLongInt(i as i64));
    }
    headers.insert("x-deep".into(), value);
    headers
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Deep tables, deep arrays and wide tables: decoding returns Ok or Invalid, never
    /// panics or overflows (this thread has the test harness's default stack), and
    /// refuses exactly the values nesting deeper than 64 levels, naming the header.
    #[test]
    fn nesting_depth_and_width_are_decoded_or_refused(
        depth in prop_oneof![0usize..80, 60usize..70, 1000usize..30_000],
        arrays in any::<bool>(),
        width in prop_oneof![0usize..4, 1000usize..3000],
    ) {
        let _shared = crate::common::timed::shared_blocking();
        let headers = nested(depth, arrays, width);
        let props = BasicProperties::default()
            .with_message_id("j".into())
            .with_headers(headers);
        let limits = Limits { max_delay_ms: 1000, max_body_bytes: 10 };
        let got = decode_parts("t", &props, b"", limits);
        if depth > redisched::job::meta::MAX_HEADER_DEPTH {
            prop_assert_eq!(
                got.map(|_| ()),
                Err(Invalid("header x-deep nests deeper than 64 levels".into()))
            );
        } else {
            prop_assert!(got.is_ok(), "{got:?}");
        }
        // Dropping a 30,000-level value recurses in drop glue: not on this thread.
        std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn(move || drop(props))
            .expect("spawn")
            .join()
            .expect("drop");
    }
}

/// Stored meta nesting deeper than the limit is refused before the recursive parser
/// sees it; meta at the limit reads back.
#[test]
fn deep_stored_meta_is_refused_without_recursion() {
    let _shared = crate::common::timed::shared_blocking();
    let encode = |depth: usize| {
        // Headers only: flags, then {x: A[A[...]]} (5 bytes per level).
        let mut meta = vec![0x20, 0x00];
        meta.extend_from_slice(&((2 + 5 * depth) as u32).to_be_bytes());
        meta.extend_from_slice(&[1, b'x']);
        for i in 0..depth {
            meta.push(b'A');
            meta.extend_from_slice(&((5 * (depth - i - 1)) as u32).to_be_bytes());
        }
        meta
    };
    assert!(decode_meta(&encode(64)).is_ok());
    let err = decode_meta(&encode(65)).expect_err("too deep");
    assert!(err.contains("deeper than 64 levels"), "{err}");
    // 200,000 levels: would overflow any stack if parsed recursively.
    let err = decode_meta(&encode(200_000)).expect_err("too deep");
    assert!(err.contains("deeper than 64 levels"), "{err}");
}

/// A header of a series or a due time, with a value that is often what a producer
/// means and sometimes not.
fn when_header() -> impl Strategy<Value = (String, AMQPValue)> {
    let name = prop_oneof![
        Just("x-redisched-op"),
        Just("x-redisched-cron"),
        Just("x-redisched-every"),
        Just("x-redisched-tz"),
        Just("x-redisched-jitter"),
        Just("x-delay"),
        Just("x-deliver-at"),
    ];
    let text = prop_oneof![
        Just("put"),
        Just("replace"),
        Just("delete"),
        Just("delete-prefix"),
        Just("0 9 * * *"),
        Just("*/2 * * * * *"),
        Just("0 0 30 2 *"),
        Just("Europe/Berlin"),
        Just("1m"),
        Just("500"),
        Just("0"),
    ];
    let value = prop_oneof![
        4 => text.prop_map(|t| AMQPValue::LongString(LongString::from(t))),
        1 => leaf(),
    ];
    (name.prop_map(str::to_string), value)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A batch reads the Redis clock before decoding only when `needs_clock` says one
    /// of its deliveries may need it: every command it says no of decodes the same
    /// without the clock as with it, so none is set aside for want of it, and every
    /// cron series accepted is one it said yes of.
    #[test]
    fn a_command_needs_the_clock_only_where_needs_clock_says(
        key in prop_oneof![3 => Just("t".to_string()), 1 => routing_key()],
        headers in proptest::collection::vec(when_header(), 0..5),
        limits in limits(),
    ) {
        let _shared = crate::common::timed::shared_blocking();
        let props = BasicProperties::default()
            .with_message_id("j".into())
            .with_headers(table(headers));
        let rules = Rules { limits, min_interval_ms: 1000 };
        let with = redisched::ingest::decode_parts(&key, &props, b"", rules, Some(NOW));
        let cron = with
            .as_ref()
            .is_ok_and(|c| c.schedule.as_ref().is_some_and(|s| s.as_str().starts_with("cron:")));
        if cron {
            prop_assert!(needs_clock(&props), "a cron series decoded without asking for the clock");
        }
        if !needs_clock(&props) {
            let without = redisched::ingest::decode_parts(&key, &props, b"", rules, None);
            prop_assert_eq!(without, with);
        }
    }
}
