//! A job's trace context: W3C Trace Context `traceparent` and `tracestate`, as a command
//! brings them and as they are stored with its job.
//!
//! An AMQP producer (an OpenTelemetry instrumentation of pika, amqplib, …) sends them as
//! headers of the command; they are stored with the job like any other header and the
//! ready message carries them unchanged, so the consumer continues the producer's trace,
//! also for a series' later occurrences. A put over HTTP brings them as request headers:
//! [`TraceContext::from_http`] checks them and [`TraceContext::insert_into`] stores them
//! as AMQP headers of the same names, so the ready message carries them exactly as for an
//! AMQP producer. What does not parse is ignored, as the W3C recommendation asks of a
//! vendor (an invalid `traceparent` is dropped with its `tracestate`; an invalid
//! `tracestate` alone); a request is never refused for it.
//!
//! The checks are those of Trace Context Level 1: version `00` is exactly
//! `00-<32 hex>-<16 hex>-<2 hex>`, lowercase; a later version (not `ff`) is read the same
//! way and may carry more after a `-`; all-zero trace and parent ids are invalid.
//! `tracestate` keeps at most 32 list members in 512 bytes: longer ones are cut as the
//! recommendation says (members over 128 bytes go first, then from the end).

use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::headers;

/// Longest `tracestate` kept, in bytes (the recommendation asks vendors to propagate at
/// least 512).
pub const MAX_TRACESTATE_LEN: usize = 512;
/// Most `tracestate` list members kept.
pub const MAX_TRACESTATE_MEMBERS: usize = 32;
/// Members longer than this are the first dropped from a `tracestate` over
/// [`MAX_TRACESTATE_LEN`].
const LONG_MEMBER: usize = 128;
/// Length of a version 00 `traceparent`.
const TRACEPARENT_LEN: usize = 55;

/// A valid W3C trace context: the `traceparent` as given, its fields, and the
/// `tracestate` (checked, cut to the bound) if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
    trace_id: u128,
    parent_id: u64,
    flags: u8,
}

impl TraceContext {
    /// A context from a `traceparent` and an optional `tracestate` header value; `None`
    /// when the `traceparent` is invalid. An invalid `tracestate` is dropped alone.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let traceparent = traceparent.trim_matches(is_ows);
        let (trace_id, parent_id, flags) = parse_traceparent(traceparent)?;
        Some(Self {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate.and_then(parse_tracestate),
            trace_id,
            parent_id,
            flags,
        })
    }

    /// A context from HTTP request headers: every `traceparent` value and every
    /// `tracestate` value, in order. More than one `traceparent` is invalid; several
    /// `tracestate` headers are one list, joined with commas (RFC 9110 field lines).
    /// Values that are not text are invalid.
    pub fn from_http<'a>(
        traceparents: impl IntoIterator<Item = &'a [u8]>,
        tracestates: impl IntoIterator<Item = &'a [u8]>,
    ) -> Option<Self> {
        let mut traceparents = traceparents.into_iter();
        let traceparent = std::str::from_utf8(traceparents.next()?).ok()?;
        if traceparents.next().is_some() {
            return None;
        }
        let mut state = String::new();
        let mut state_ok = true;
        for value in tracestates {
            match std::str::from_utf8(value) {
                Ok(text) => {
                    if !state.is_empty() {
                        state.push(',');
                    }
                    state.push_str(text);
                }
                Err(_) => state_ok = false,
            }
        }
        let tracestate = (state_ok && !state.is_empty()).then_some(state.as_str());
        Self::parse(traceparent, tracestate)
    }

    /// The context stored in a job's headers (`traceparent`, `tracestate` as text), if a
    /// valid one is there.
    pub fn of_headers(table: &FieldTable) -> Option<Self> {
        let map = table.inner();
        let traceparent = text(map.get(headers::TRACEPARENT)?)?;
        let tracestate = map.get(headers::TRACESTATE).and_then(text);
        Self::parse(traceparent, tracestate)
    }

    /// [`TraceContext::of_headers`] of a job's stored properties.
    pub fn of_props(props: &AMQPProperties) -> Option<Self> {
        props.headers().as_ref().and_then(Self::of_headers)
    }

    /// Stores the context as the headers `traceparent` and `tracestate` (long strings, as
    /// the AMQP instrumentations send them), replacing any there.
    pub fn insert_into(&self, table: &mut FieldTable) {
        table.insert(
            headers::TRACEPARENT.into(),
            AMQPValue::LongString(self.traceparent.as_bytes().to_vec().into()),
        );
        match &self.tracestate {
            Some(state) => {
                table.insert(
                    headers::TRACESTATE.into(),
                    AMQPValue::LongString(state.as_bytes().to_vec().into()),
                );
            }
            // A stale one would describe another sender's state (FieldTable has no remove).
            None if table.contains_key(headers::TRACESTATE) => {
                let mut map = table.inner().clone();
                map.remove(headers::TRACESTATE);
                *table = map.into();
            }
            None => {}
        }
    }

    /// A context of our own making (a span the bridge started), in version 00 form;
    /// `None` for all-zero ids.
    pub fn from_parts(
        trace_id: u128,
        parent_id: u64,
        flags: u8,
        tracestate: Option<&str>,
    ) -> Option<Self> {
        let traceparent = format!("00-{trace_id:032x}-{parent_id:016x}-{flags:02x}");
        Self::parse(&traceparent, tracestate)
    }

    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    pub fn trace_id(&self) -> u128 {
        self.trace_id
    }

    /// The id of the span that sent it (the parent of whatever continues it).
    pub fn parent_id(&self) -> u64 {
        self.parent_id
    }

    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the sender recorded its span (flag bit 0), which a parent-based sampler
    /// follows.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// The stored meta of a put over REST or the seed endpoint: [`super::meta::of_put`] plus
/// the request's trace context as headers; empty with none of them.
pub fn meta_of_put(url: Option<&str>, jitter_ms: u64, trace: Option<&TraceContext>) -> Vec<u8> {
    let Some(trace) = trace else {
        return super::meta::of_put(url, jitter_ms);
    };
    let meta = super::meta::of_put(url, jitter_ms);
    let props = super::meta::decode_meta(&meta).unwrap_or_default();
    let mut table = props.headers().clone().unwrap_or_default();
    trace.insert_into(&mut table);
    super::meta::encode_meta(&props.with_headers(table))
}

fn text(value: &AMQPValue) -> Option<&str> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

/// Optional whitespace of HTTP (space and tab).
fn is_ows(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// Lowercase hex digits only (the recommendation refuses uppercase).
fn hex(field: &str) -> Option<u128> {
    if field.is_empty()
        || !field
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return None;
    }
    u128::from_str_radix(field, 16).ok()
}

/// (trace id, parent id, flags) of a valid `traceparent`.
fn parse_traceparent(value: &str) -> Option<(u128, u64, u8)> {
    let bytes = value.as_bytes();
    if bytes.len() < TRACEPARENT_LEN {
        return None;
    }
    let version = hex(value.get(0..2)?)?;
    // ff is invalid; 00 has exactly four fields; a later version may add fields after
    // a `-`, which a reader of version 00 skips.
    if version == 0xff
        || (version == 0 && bytes.len() != TRACEPARENT_LEN)
        || (bytes.len() > TRACEPARENT_LEN && bytes[TRACEPARENT_LEN] != b'-')
    {
        return None;
    }
    if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
        return None;
    }
    let trace_id = hex(value.get(3..35)?)?;
    let parent_id = u64::try_from(hex(value.get(36..52)?)?).ok()?;
    let flags = u8::try_from(hex(value.get(53..55)?)?).ok()?;
    (trace_id != 0 && parent_id != 0).then_some((trace_id, parent_id, flags))
}

/// A valid `tracestate` cut to the bounds; `None` when invalid or empty.
fn parse_tracestate(value: &str) -> Option<String> {
    let mut members: Vec<&str> = Vec::new();
    let mut keys: Vec<&str> = Vec::new();
    for member in value.split(',') {
        let member = member.trim_matches(is_ows);
        if member.is_empty() {
            continue;
        }
        let (key, val) = member.split_once('=')?;
        if !valid_key(key) || !valid_value(val) || keys.contains(&key) {
            return None;
        }
        keys.push(key);
        members.push(member);
    }
    let size = |members: &[&str]| -> usize {
        members.iter().map(|m| m.len()).sum::<usize>() + members.len().saturating_sub(1)
    };
    if members.len() > MAX_TRACESTATE_MEMBERS || size(&members) > MAX_TRACESTATE_LEN {
        // Members over 128 bytes go first, then the last ones, until it fits.
        while size(&members) > MAX_TRACESTATE_LEN {
            match members.iter().rposition(|m| m.len() > LONG_MEMBER) {
                Some(at) => members.remove(at),
                None => break,
            };
        }
        members.truncate(MAX_TRACESTATE_MEMBERS);
        while size(&members) > MAX_TRACESTATE_LEN {
            members.pop();
        }
    }
    (!members.is_empty()).then(|| members.join(","))
}

fn key_char(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/')
}

/// `simple-key` (a lowercase letter, then up to 255 key characters) or
/// `tenant-id@system-id` (a letter or digit and up to 240 more; a letter and up to 13).
fn valid_key(key: &str) -> bool {
    let part = |s: &str, first_digit_ok: bool, max: usize| {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= max
            && (b[0].is_ascii_lowercase() || (first_digit_ok && b[0].is_ascii_digit()))
            && b.iter().all(|&c| key_char(c))
    };
    match key.split_once('@') {
        None => part(key, false, 256),
        Some((tenant, system)) => part(tenant, true, 241) && part(system, false, 14),
    }
}

/// 1 to 256 printable ASCII characters but `,` and `=`, not ending in a space.
fn valid_value(value: &str) -> bool {
    let b = value.as_bytes();
    !b.is_empty()
        && b.len() <= 256
        && b.iter()
            .all(|&c| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=')
        && b[b.len() - 1] != b' '
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_read_and_kept_as_given() {
        let cx = TraceContext::parse(GOOD, Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"))
            .expect("valid");
        assert_eq!(cx.traceparent(), GOOD);
        assert_eq!(cx.trace_id(), 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(cx.parent_id(), 0x00f067aa0ba902b7);
        assert!(cx.sampled());
        assert_eq!(
            cx.tracestate(),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
        );
        let padded = TraceContext::parse(&format!(" {GOOD}\t"), None).expect("OWS trimmed");
        assert_eq!(padded.traceparent(), GOOD);
        assert!(!TraceContext::parse(&GOOD.replace("-01", "-00"), None)
            .unwrap()
            .sampled());
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // uppercase, all-zero ids, version ff, wrong separators, extra fields on 00
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "é0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad, Some("a=b")), None, "{bad:?}");
        }
        // A later version is read as 00 is, with more fields after a dash.
        let later =
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-will-be-like";
        assert!(TraceContext::parse(later, None).is_some());
    }

    #[test]
    fn an_invalid_tracestate_is_dropped_alone() {
        for bad in [
            "Rojo=1",
            "rojo",
            "rojo=1,rojo=2",
            "rojo=a\tb",
            "rojo=",
            "rojo=a=b",
            "1rojo=x",
            "tenant@Sys=x",
            "tenant@system-id-too-long=x",
        ] {
            let cx = TraceContext::parse(GOOD, Some(bad)).expect("traceparent stands");
            assert_eq!(cx.tracestate(), None, "{bad:?}");
        }
        let cx = TraceContext::parse(GOOD, Some(" , 1tenant@sys=x ,, b=c d ")).expect("valid");
        assert_eq!(cx.tracestate(), Some("1tenant@sys=x,b=c d"));
        assert_eq!(
            TraceContext::parse(GOOD, Some(" , ")).unwrap().tracestate(),
            None
        );
    }

    #[test]
    fn tracestate_is_cut_to_its_bounds() {
        let many: Vec<String> = (0..40).map(|i| format!("k{i}=v")).collect();
        let cx = TraceContext::parse(GOOD, Some(&many.join(","))).unwrap();
        let kept: Vec<&str> = cx.tracestate().unwrap().split(',').collect();
        assert_eq!(kept.len(), MAX_TRACESTATE_MEMBERS);
        assert_eq!(kept[31], "k31=v");

        // Over 512 bytes: the long member goes first, the short ones stay.
        let long = format!("long={}", "x".repeat(200));
        let filler: Vec<String> = (0..4).map(|i| format!("f{i}={}", "y".repeat(90))).collect();
        let state = format!("a=1,{long},{}", filler.join(","));
        assert!(state.len() > MAX_TRACESTATE_LEN);
        let cx = TraceContext::parse(GOOD, Some(&state)).unwrap();
        let kept = cx.tracestate().unwrap();
        assert!(!kept.contains("long="), "{kept}");
        assert!(kept.starts_with("a=1,f0="), "{kept}");
        assert!(kept.len() <= MAX_TRACESTATE_LEN);

        // Short members only: cut from the end.
        let filler: Vec<String> = (0..10)
            .map(|i| format!("g{i}={}", "z".repeat(100)))
            .collect();
        let cx = TraceContext::parse(GOOD, Some(&filler.join(","))).unwrap();
        let kept = cx.tracestate().unwrap();
        assert!(kept.len() <= MAX_TRACESTATE_LEN && kept.starts_with("g0="));
        assert_eq!(kept.split(',').count(), 4);
    }

    #[test]
    fn http_headers_one_traceparent_and_any_tracestate_lines() {
        let good = GOOD.as_bytes();
        let cx = TraceContext::from_http([good], [&b"a=1"[..], &b"b=2"[..]]).unwrap();
        assert_eq!(cx.tracestate(), Some("a=1,b=2"));
        assert_eq!(TraceContext::from_http([good, good], []), None);
        assert_eq!(TraceContext::from_http([], [&b"a=1"[..]]), None);
        let cx = TraceContext::from_http([good], [&b"\xff"[..]]).unwrap();
        assert_eq!(cx.tracestate(), None);
        assert_eq!(TraceContext::from_http([&b"\xff"[..]], []), None);
    }

    #[test]
    fn stored_as_headers_and_read_back() {
        let cx = TraceContext::parse(GOOD, Some("a=1")).unwrap();
        let mut table = FieldTable::default();
        table.insert("tracestate".into(), AMQPValue::LongString("old=1".into()));
        cx.insert_into(&mut table);
        assert_eq!(TraceContext::of_headers(&table), Some(cx.clone()));
        let bare = TraceContext::parse(GOOD, None).unwrap();
        bare.insert_into(&mut table);
        assert!(
            !table.contains_key("tracestate"),
            "a stale tracestate is not left behind"
        );
        // As a short string too (some clients send those); another type is not text.
        let mut short = FieldTable::default();
        short.insert("traceparent".into(), AMQPValue::ShortString(GOOD.into()));
        assert!(TraceContext::of_headers(&short).is_some());
        let mut odd = FieldTable::default();
        odd.insert("traceparent".into(), AMQPValue::LongLongInt(1));
        assert_eq!(TraceContext::of_headers(&odd), None);

        let ours = TraceContext::from_parts(7, 9, 1, None).unwrap();
        assert_eq!(
            ours.traceparent(),
            "00-00000000000000000000000000000007-0000000000000009-01"
        );
        assert_eq!(TraceContext::from_parts(0, 9, 1, None), None);
    }

    /// The bytes a trace context adds to a stored job (the figure in the report): none
    /// without one; `traceparent` alone, and with a typical `tracestate`, beside no other
    /// header and beside a job's own URL.
    #[test]
    fn bytes_a_trace_context_adds_to_a_stored_job() {
        let none = meta_of_put(None, 0, None);
        assert!(none.is_empty(), "nothing when absent");
        let parent = TraceContext::parse(GOOD, None).unwrap();
        let with_state = TraceContext::parse(GOOD, Some("rojo=00f067aa0ba902b7")).unwrap();
        let alone = meta_of_put(None, 0, Some(&parent)).len();
        let alone_state = meta_of_put(None, 0, Some(&with_state)).len();
        let url = Some("https://example.com/hook");
        let base_url = meta_of_put(url, 0, None).len();
        let beside_url = meta_of_put(url, 0, Some(&parent)).len() - base_url;
        println!(
            "trace context bytes: traceparent alone {alone}, with tracestate (21 chars) {alone_state}, \
             beside other headers +{beside_url}"
        );
        // flags (2) + table length (4) + key (1 + 11) + type (1) + length (4) + 55.
        assert_eq!(alone, 78);
        // + key (1 + 10) + type (1) + length (4) + 21.
        assert_eq!(alone_state, 78 + 37);
        assert_eq!(beside_url, 72);
        let decoded = super::super::meta::decode_meta(&meta_of_put(url, 5, Some(&with_state)))
            .expect("decodes");
        assert_eq!(TraceContext::of_props(&decoded), Some(with_state));
        assert_eq!(super::super::meta::jitter_of(&decoded), 5);
    }
}
