//! What of a command's AMQP properties travels with its job, and how it is stored.
//!
//! The job's `meta` is the AMQP 0-9-1 encoding of basic properties (property flags then
//! fields, as in a content header frame): exact for every header type (nested tables,
//! arrays, byte arrays, typed integers), compact, and readable by any AMQP codec.

use lapin::protocol::basic::{gen_properties, parse_properties, AMQPProperties};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::headers;

/// How deeply a header value may nest tables and arrays (a scalar is 0 levels, a table
/// of scalars 1). Deeper commands are refused: the AMQP codec recurses once per level
/// (parse, serialize, clone, drop), so an unbounded depth would be a stack overflow
/// waiting for the right header. 64 is far beyond any real header.
pub const MAX_HEADER_DEPTH: usize = 64;

/// The first header (in key order) whose value nests tables and arrays deeper than
/// [`MAX_HEADER_DEPTH`], as a reason in the producer's terms. An iterative walk with an
/// explicit stack: it must not itself recurse on the depth it is measuring.
pub fn too_deep(table: &FieldTable) -> Option<String> {
    for (key, value) in table {
        let mut pending: Vec<(&AMQPValue, usize)> = vec![(value, 0)];
        while let Some((value, above)) = pending.pop() {
            let children: Box<dyn Iterator<Item = &AMQPValue>> = match value {
                AMQPValue::FieldTable(t) => Box::new(t.inner().values()),
                AMQPValue::FieldArray(a) => Box::new(a.as_slice().iter()),
                _ => continue,
            };
            let depth = above + 1;
            if depth > MAX_HEADER_DEPTH {
                return Some(format!(
                    "header {} nests deeper than {MAX_HEADER_DEPTH} levels",
                    key.as_str()
                ));
            }
            pending.extend(children.map(|child| (child, depth)));
        }
    }
    None
}

/// The part of a command's properties that is stored and forwarded: content type and
/// encoding, type, app id, correlation id, priority, timestamp, and every header but
/// the control ones and the bridge's own output headers (`x-redisched-error`, `-topic`,
/// `-due-at`, `-attempt`: written afresh on each delivery). Schedule headers
/// (`x-redisched-every`, `-cron`, `-tz`) are kept: each occurrence carries them as given.
/// Deliberately left behind: `message_id` (the job id travels on
/// its own), `reply_to` (it addresses the command's reply), `expiration` (a TTL meant
/// for the command queue must not silently expire the delivered job), `user_id` (the
/// broker rejects a publish whose user_id is not the publishing user), `delivery_mode`
/// (jobs are always delivered persistent) and the deprecated `cluster_id`.
pub fn forwardable(props: &BasicProperties) -> AMQPProperties {
    let mut kept = AMQPProperties::default();
    if let Some(v) = props.content_type() {
        kept = kept.with_content_type(v.clone());
    }
    if let Some(v) = props.content_encoding() {
        kept = kept.with_content_encoding(v.clone());
    }
    if let Some(v) = props.kind() {
        kept = kept.with_type(v.clone());
    }
    if let Some(v) = props.app_id() {
        kept = kept.with_app_id(v.clone());
    }
    if let Some(v) = props.correlation_id() {
        kept = kept.with_correlation_id(v.clone());
    }
    if let Some(v) = props.priority() {
        kept = kept.with_priority(*v);
    }
    if let Some(v) = props.timestamp() {
        kept = kept.with_timestamp(*v);
    }
    if let Some(table) = props.headers() {
        let mut rest = FieldTable::default();
        for (key, value) in table {
            let key_str = key.as_str();
            if !headers::CONTROL.contains(&key_str) && !headers::OUTPUT.contains(&key_str) {
                rest.insert(key.clone(), value.clone());
            }
        }
        if !rest.inner().is_empty() {
            kept = kept.with_headers(rest);
        }
    }
    kept
}

/// The job id a command names: `message_id`, else the `x-redisched-id` header (shell
/// producers such as `amqp-publish` cannot set `message_id`). `Err` with both present
/// and different; `Ok(None)` with neither. Text only: any other header type is refused.
pub fn job_id(props: &BasicProperties) -> Result<Option<String>, String> {
    let from_header = match props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::ID))
    {
        None => None,
        Some(AMQPValue::LongString(s)) => Some(
            std::str::from_utf8(s.as_bytes())
                .map_err(|_| format!("{} is not UTF-8 text", headers::ID))?
                .to_owned(),
        ),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_owned()),
        Some(_) => return Err(format!("{} must be a text header", headers::ID)),
    };
    match (
        props.message_id().as_ref().map(|id| id.as_str()),
        from_header,
    ) {
        (Some(id), Some(header)) if id != header => Err(format!(
            "message_id {id:?} and {} {header:?} differ; give one, or the same",
            headers::ID
        )),
        (Some(id), _) => Ok(Some(id.to_owned())),
        (None, header) => Ok(header),
    }
}

/// Adds `x-delay` = −`delay_ms` to delivered properties, as RabbitMQ's delayed-message
/// plugin delivers it, so consumers written for the plugin keep working. 32-bit when it
/// fits (as the plugin sends it), 64-bit beyond.
pub fn with_plugin_delay(props: AMQPProperties, delay_ms: i64) -> AMQPProperties {
    let negative = -delay_ms.max(0);
    let value = i32::try_from(negative)
        .map(AMQPValue::LongInt)
        .unwrap_or(AMQPValue::LongLongInt(negative));
    let mut table = props.headers().clone().unwrap_or_default();
    table.insert(headers::DELAY.into(), value);
    props.with_headers(table)
}

/// Encodes properties for storage; no properties at all is stored as empty bytes.
pub fn encode_meta(props: &AMQPProperties) -> Vec<u8> {
    if *props == AMQPProperties::default() {
        return Vec::new();
    }
    // Serialising into a growable Vec cannot run out of room.
    cookie_factory::gen_simple(gen_properties(props), Vec::new()).unwrap_or_default()
}

/// Decodes stored properties. Meta written by other clients may be anything: what does
/// not parse is reported, and the job is still delivered with the properties we can
/// vouch for.
pub fn decode_meta(meta: &[u8]) -> Result<AMQPProperties, String> {
    if meta.is_empty() {
        return Ok(AMQPProperties::default());
    }
    // The parser recurses per nesting level; meta written by another client may nest as
    // deep as its size allows, so the depth is measured first, without recursion.
    if let Some(depth) = encoded_header_depth(meta) {
        if depth > MAX_HEADER_DEPTH + 1 {
            return Err(format!(
                "unreadable properties: headers nest deeper than {MAX_HEADER_DEPTH} levels"
            ));
        }
    }
    match parse_properties(meta) {
        Ok(([], props)) => Ok(props),
        Ok((rest, _)) => Err(format!(
            "{} trailing bytes after the properties",
            rest.len()
        )),
        Err(err) => Err(format!("unreadable properties: {err}")),
    }
}

/// How deeply the headers table of AMQP-encoded basic properties nests (the table itself
/// counts 1), found by walking the bytes with an explicit stack; `None` when there are no
/// headers or the bytes are malformed before the walk could go on (the parser then
/// refuses them at the same point, before it nests any deeper than the walk did).
fn encoded_header_depth(meta: &[u8]) -> Option<usize> {
    let flags = u16::from_be_bytes([*meta.first()?, *meta.get(1)?]);
    // Property flags: content-type, content-encoding, headers, ... (bit 15 down); a set
    // bit 0 would announce another flag word, which basic properties never need.
    let mut at = 2;
    if flags & 1 != 0 {
        return None;
    }
    for bit in [0x8000u16, 0x4000] {
        if flags & bit != 0 {
            at += 1 + usize::from(*meta.get(at)?);
        }
    }
    if flags & 0x2000 == 0 {
        return None;
    }
    // Each open table or array: where it ends, and whether it is a table (whose entries
    // start with a short-string key).
    let mut open: Vec<(usize, bool)> = Vec::new();
    let mut deepest = 0;
    let mut value = Some(b'F');
    loop {
        if let Some(tag) = value.take() {
            let fixed = match tag {
                b't' | b'b' | b'B' => 1,
                b's' | b'U' | b'u' => 2,
                b'I' | b'i' | b'f' => 4,
                b'L' | b'l' | b'd' | b'T' => 8,
                b'D' => 5,
                b'V' => 0,
                b'S' | b'x' | b'A' | b'F' => {
                    let len = u32::from_be_bytes(meta.get(at..at + 4)?.try_into().ok()?);
                    at += 4;
                    let end = at.checked_add(usize::try_from(len).ok()?)?;
                    if tag == b'A' || tag == b'F' {
                        open.push((end, tag == b'F'));
                        deepest = deepest.max(open.len());
                        if deepest > MAX_HEADER_DEPTH + 1 {
                            return Some(deepest);
                        }
                        0
                    } else {
                        end - at
                    }
                }
                _ => return Some(deepest),
            };
            at += fixed;
        }
        let &(end, is_table) = open.last()?;
        if at >= end {
            open.pop();
            if open.is_empty() {
                return Some(deepest);
            }
            continue;
        }
        if is_table {
            at += 1 + usize::from(*meta.get(at)?);
        }
        value = Some(*meta.get(at)?);
        at += 1;
    }
}

/// A header holding an integer of any AMQP width, widened; `None` for any other type.
/// The one reading of integer headers that ingest, expiry and jitter share.
pub fn integer(value: &AMQPValue) -> Option<i64> {
    Some(match value {
        AMQPValue::ShortShortInt(v) => i64::from(*v),
        AMQPValue::ShortShortUInt(v) => i64::from(*v),
        AMQPValue::ShortInt(v) => i64::from(*v),
        AMQPValue::ShortUInt(v) => i64::from(*v),
        AMQPValue::LongInt(v) => i64::from(*v),
        AMQPValue::LongUInt(v) => i64::from(*v),
        AMQPValue::LongLongInt(v) => *v,
        _ => return None,
    })
}

/// The jitter (ms) a series' stored properties carry in `x-redisched-jitter`: an
/// integer or a numeric string >= 0, as ingest accepted it; `0` for none (or for a
/// value no release of this bridge would have stored).
pub fn jitter_of(props: &AMQPProperties) -> u64 {
    let Some(value) = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::JITTER))
    else {
        return 0;
    };
    let ms = integer(value).unwrap_or_else(|| match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().unwrap_or(0),
        _ => 0,
    });
    u64::try_from(ms).unwrap_or(0)
}

/// The stored meta of a job put through REST or the CLI: its own URL
/// (`x-redisched-url`) and a series' jitter (`x-redisched-jitter`, which dispatch reads
/// from there), as an AMQP producer would have sent them; empty with neither.
pub fn of_put(url: Option<&str>, jitter_ms: u64) -> Vec<u8> {
    let mut table = FieldTable::default();
    if let Some(url) = url {
        table.insert(
            headers::URL.into(),
            AMQPValue::LongString(url.as_bytes().to_vec().into()),
        );
    }
    if jitter_ms > 0 {
        table.insert(
            headers::JITTER.into(),
            AMQPValue::LongLongInt(i64::try_from(jitter_ms).unwrap_or(i64::MAX)),
        );
    }
    if table.inner().is_empty() {
        return Vec::new();
    }
    encode_meta(&AMQPProperties::default().with_headers(table))
}

/// The job's own URL from its stored headers, if it has one.
pub fn own_url(props: &AMQPProperties) -> Result<Option<String>, String> {
    match props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::URL))
    {
        None => Ok(None),
        Some(AMQPValue::LongString(s)) => std::str::from_utf8(s.as_bytes())
            .map(|s| Some(s.to_owned()))
            .map_err(|_| format!("{} is not UTF-8 text", headers::URL)),
        Some(AMQPValue::ShortString(s)) => Ok(Some(s.as_str().to_owned())),
        Some(_) => Err(format!("{} must be a text header", headers::URL)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{ByteArray, FieldArray};

    #[test]
    fn every_header_type_survives_storage_and_control_fields_do_not() {
        let mut nested = FieldTable::default();
        nested.insert("deep".into(), AMQPValue::LongUInt(7));
        let mut table = FieldTable::default();
        table.insert("s".into(), AMQPValue::LongString("text".into()));
        table.insert("i8".into(), AMQPValue::ShortShortInt(-3));
        table.insert("i64".into(), AMQPValue::LongLongInt(-1 << 40));
        table.insert("b".into(), AMQPValue::Boolean(true));
        table.insert("f".into(), AMQPValue::Double(1.5));
        table.insert("t".into(), AMQPValue::FieldTable(nested));
        table.insert(
            "a".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::ShortUInt(1),
                AMQPValue::Void,
            ])),
        );
        table.insert(
            "x".into(),
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 255, 10])),
        );
        table.insert(headers::DELAY.into(), AMQPValue::LongLongInt(5000));
        table.insert(headers::OP.into(), AMQPValue::LongString("replace".into()));
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id("job-1".into())
            .with_expiration("60000".into())
            .with_reply_to("replies".into())
            .with_user_id("alice".into())
            .with_priority(3)
            .with_timestamp(1_700_000_000)
            .with_headers(table);

        let kept = forwardable(&props);
        let decoded = decode_meta(&encode_meta(&kept)).expect("round trip");
        assert_eq!(decoded, kept);
        assert_eq!(decoded.message_id(), &None);
        assert_eq!(decoded.expiration(), &None);
        assert_eq!(decoded.reply_to(), &None);
        assert_eq!(decoded.user_id(), &None);
        assert_eq!(decoded.priority(), &Some(3));
        let headers = decoded.headers().clone().expect("headers kept");
        assert!(!headers.contains_key(headers::DELAY) && !headers.contains_key(headers::OP));
        assert_eq!(headers.inner().len(), 8);
        assert_eq!(
            headers.inner().get("x"),
            Some(&AMQPValue::ByteArray(ByteArray::from(vec![0u8, 255, 10])))
        );
    }

    #[test]
    fn no_properties_store_as_nothing_and_garbage_is_reported() {
        assert!(encode_meta(&AMQPProperties::default()).is_empty());
        assert_eq!(decode_meta(b""), Ok(AMQPProperties::default()));
        assert!(decode_meta(b"\xff\xff\x01").is_err());
    }
}
