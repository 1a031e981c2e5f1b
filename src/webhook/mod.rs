//! The webhook transport: one HTTP client per target, the request a due job becomes
//! (headers, body, Standard Webhooks signature) and what the answer means. It knows
//! nothing of Redis or of dispatch: the sink in `dispatch/webhook_sink.rs` reserves,
//! calls [`Client::post`] and reports the outcome to the settle module.

mod resolve;
mod sign;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use hyper::body::Bytes;
use lapin::protocol::basic::AMQPProperties;
use lapin::types::AMQPValue;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};

use crate::job::headers;
use crate::targets::{BodyMode, TargetConfig};
pub use sign::{signature, webhook_id};

/// The request header carrying the job's own URL (`allowed_url_prefixes`).
pub const URL_HEADER: &str = headers::URL;
use crate::job::meta::own_url;
/// The prefix of forwarded AMQP headers (`forward_headers = true`).
pub const FORWARDED_PREFIX: &str = "x-redisched-header-";
/// How much of a 2xx answer's body is read (and dropped) to keep the connection.
const SUCCESS_BODY_BYTES: usize = 64 * 1024;
/// How much of a failed response's body `last_error` quotes.
const ERROR_BODY_BYTES: usize = 200;

// The names every request carries, built at compile time rather than parsed per request.
const TOPIC: HeaderName = HeaderName::from_static(headers::TOPIC);
const ID: HeaderName = HeaderName::from_static(headers::ID);
const DUE_AT: HeaderName = HeaderName::from_static(headers::DUE_AT);
const ATTEMPT: HeaderName = HeaderName::from_static(headers::ATTEMPT);
const SCHEDULED_AT: HeaderName = HeaderName::from_static(headers::SCHEDULED_AT);
const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
/// Headers a request adds to the target's own (forwarded ones aside): no regrowth.
const OWN_HEADERS: usize = 9;

/// One due job as the transport sees it.
#[derive(Debug)]
pub struct Outgoing<'a> {
    pub topic: &'a str,
    pub id: &'a str,
    /// When it was due (a series occurrence's jittered time).
    pub due_at: i64,
    /// The occurrence's scheduled time before its jitter (`due_at` when none).
    pub scheduled_at: i64,
    pub attempt: u32,
    /// Shared, not copied, into a raw request's body.
    pub body: &'a Bytes,
    /// The job's stored AMQP properties (content type, forwarded headers, its URL).
    pub props: &'a AMQPProperties,
}

/// A failed attempt: the metrics code, the `last_error` text, and a `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// `4xx`, `5xx`, `timeout`, `connect`, `tls` (or `3xx`, `1xx`, `url`, `error`).
    pub code: &'static str,
    /// The HTTP status, when there was an answer.
    pub status: Option<u16>,
    pub reason: String,
    pub retry_after: Option<Duration>,
}

/// What a 2xx answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    pub status: u16,
}

impl Failure {
    /// A failure no retry can mend: the job's own URL is refused by the guard (or no
    /// longer allowed by the target's configuration). Its job is parked at once, to be
    /// re-driven once the cause is fixed.
    pub fn is_refusal(&self) -> bool {
        self.code == "url"
    }
}

/// A target's client: pooled keep-alive connections, HTTP/2 when the server offers it
/// (ALPN), no redirects, `HTTPS_PROXY` / `NO_PROXY` from the environment.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// The client of jobs' own URLs, unless the target allows private ones: its
    /// resolver keeps only global addresses, and it connects directly (a proxy would
    /// resolve the name where the guard cannot see the address).
    guarded: Option<reqwest::Client>,
    pub target: Arc<TargetConfig>,
    keys: Arc<Vec<Vec<u8>>>,
    extra: HeaderMap,
    /// The target's URL, parsed once: the common case (no per-job URL) then costs no
    /// parse (with its IDNA pass) per request.
    url: reqwest::Url,
}

impl Client {
    pub fn new(target: TargetConfig) -> Result<Self, String> {
        let http = http_client(&target, false)?;
        let guarded = (!target.allowed_url_prefixes.is_empty() && !target.allow_private_job_urls)
            .then(|| http_client(&target, true))
            .transpose()?;
        let keys = target
            .signing_secrets
            .iter()
            .map(|s| crate::targets::secret_key(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("target {}: {e}", target.name))?;
        let mut extra = HeaderMap::new();
        for (name, value) in &target.headers {
            let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) else {
                return Err(format!("target {}: bad header {name}", target.name));
            };
            extra.insert(name, value);
        }
        let url = reqwest::Url::parse(&target.url)
            .map_err(|e| format!("target {}: url: {e}", target.name))?;
        Ok(Self {
            http,
            guarded,
            target: Arc::new(target),
            keys: Arc::new(keys),
            extra,
            url,
        })
    }

    /// POSTs one job and says what came of it; also returns how long it took.
    pub async fn post(&self, job: &Outgoing<'_>) -> (Result<Delivered, Failure>, Duration) {
        let started = Instant::now();
        let result = self.try_post(job).await;
        (result, started.elapsed())
    }

    /// The request's headers: the target's own, the forwarded ones, the job's
    /// (`x-redisched-*`) and the Standard Webhooks id, timestamp and signature of `body`.
    /// Each is inserted in that order, a later one replacing an earlier of its name.
    fn request_headers(&self, job: &Outgoing<'_>, body: &[u8]) -> HeaderMap {
        let mut map = if self.extra.is_empty() {
            HeaderMap::with_capacity(OWN_HEADERS)
        } else {
            let mut map = self.extra.clone();
            map.reserve(OWN_HEADERS);
            map
        };
        if self.target.forward_headers {
            forward(job.props, &mut map);
        }
        let content_type = match (self.target.body_mode(), job.props.content_type()) {
            (BodyMode::Seed, _) => Ok(HeaderValue::from_static("application/json")),
            (BodyMode::Raw, Some(ct)) => HeaderValue::from_str(ct.as_str()),
            (BodyMode::Raw, None) => Ok(HeaderValue::from_static("application/octet-stream")),
        };
        // As before: a value that cannot be a header value is left out, not an error.
        if let Ok(value) = content_type {
            map.insert(CONTENT_TYPE, value);
        }
        if let Ok(value) = HeaderValue::from_str(job.topic) {
            map.insert(TOPIC, value);
        }
        if let Ok(value) = header_safe_value(job.id) {
            map.insert(ID, value);
        }
        map.insert(DUE_AT, decimal(job.due_at));
        map.insert(ATTEMPT, decimal(job.attempt));
        map.insert(SCHEDULED_AT, decimal(job.scheduled_at));
        let msg_id = webhook_id(job.topic, job.id, job.due_at, job.body, job.props);
        let timestamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let signed =
            (!self.keys.is_empty()).then(|| signature(&self.keys, &msg_id, timestamp, body));
        if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(msg_id)) {
            map.insert(WEBHOOK_ID, value);
        }
        map.insert(WEBHOOK_TIMESTAMP, decimal(timestamp));
        if let Some(Ok(value)) = signed.map(|s| HeaderValue::from_maybe_shared(Bytes::from(s))) {
            map.insert(WEBHOOK_SIGNATURE, value);
        }
        map
    }

    async fn try_post(&self, job: &Outgoing<'_>) -> Result<Delivered, Failure> {
        let name = &self.target.name;
        // A job's own URL is checked again here (the configuration may have changed
        // since ingest), and what is requested is exactly the URL that was checked.
        let (parsed, http, own) = match own_url(job.props).map_err(|r| failure("url", r))? {
            None => (self.url.clone(), &self.http, None),
            Some(raw) => {
                let checked = self
                    .target
                    .check_job_url(&raw)
                    .map_err(|reason| failure("url", reason))?;
                let shown = checked.as_str().to_owned();
                let http = self.guarded.as_ref().unwrap_or(&self.http);
                (checked, http, Some(shown))
            }
        };
        let url = own.as_deref().unwrap_or(&self.target.url);
        let body = match self.target.body_mode() {
            BodyMode::Raw => job.body.clone(),
            BodyMode::Seed => Bytes::from(seed_body(job)),
        };
        // Built whole rather than through `RequestBuilder`, which would copy the
        // headers over one by one into a map of its own.
        let mut request = reqwest::Request::new(reqwest::Method::POST, parsed);
        *request.headers_mut() = self.request_headers(job, &body);
        *request.body_mut() = Some(body.into());
        let response = http
            .execute(request)
            .await
            .map_err(|e| transport_failure(name, self.target.timeout_ms, url, &e))?;
        let status = response.status();
        if status.is_success() {
            // Reading a short answer to its end lets the connection go back to the pool;
            // a long one is not worth waiting for (the job is delivered either way).
            let mut response = response;
            let mut read = 0;
            while read < SUCCESS_BODY_BYTES {
                match response.chunk().await {
                    Ok(Some(chunk)) => read += chunk.len(),
                    _ => break,
                }
            }
            return Ok(Delivered {
                status: status.as_u16(),
            });
        }
        Err(refusal(name, response).await)
    }
}

/// A target's HTTP client; `guarded`: the one of jobs' own URLs (see [`Client`]).
fn http_client(target: &TargetConfig, guarded: bool) -> Result<reqwest::Client, String> {
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_millis(target.timeout_ms))
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(target.max_in_flight);
    if guarded {
        builder = builder
            .dns_resolver(Arc::new(resolve::GlobalOnly))
            .no_proxy();
    }
    #[cfg(feature = "tls")]
    {
        let tls = crate::tls::http_tls_config(crate::tls::ca_file(&target.tls_ca_file))
            .map_err(|e| format!("target {}: {e}", target.name))?;
        builder = builder.use_preconfigured_tls(tls);
    }
    builder
        .build()
        .map_err(|e| format!("target {}: cannot build its HTTP client: {e}", target.name))
}

/// What a non-2xx answer means: its class, `Retry-After` (429 and 503 only), and a
/// reason naming the status and the start of the body.
async fn refusal(name: &str, response: reqwest::Response) -> Failure {
    let status = response.status();
    let retry_after = if matches!(status.as_u16(), 429 | 503) {
        response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()))
    } else {
        None
    };
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // The body only says why: a slow or huge one is cut, not awaited in full.
    let mut text = Vec::new();
    let mut response = response;
    while text.len() < ERROR_BODY_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => text.extend_from_slice(&chunk),
            _ => break,
        }
    }
    text.truncate(ERROR_BODY_BYTES);
    let mut reason = format!(
        "HTTP {} {} from {name}: {}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        String::from_utf8_lossy(&text)
    );
    if let (true, Some(location)) = (status.is_redirection(), location) {
        reason = format!("{reason} (redirect to {location} not followed)");
    }
    Failure {
        code: status_code_class(status.as_u16()),
        status: Some(status.as_u16()),
        reason,
        retry_after,
    }
}

/// A number as `to_string` writes it, as a header value, formatted on the stack (`itoa`)
/// rather than through a growable buffer as `HeaderValue::from` for integers does.
fn decimal(n: impl itoa::Integer) -> HeaderValue {
    HeaderValue::from_str(itoa::Buffer::new().format(n))
        .unwrap_or_else(|_| HeaderValue::from_static("0"))
}

fn failure(code: &'static str, reason: String) -> Failure {
    Failure {
        code,
        status: None,
        reason,
        retry_after: None,
    }
}

fn put(map: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        map.insert(name, value);
    }
}

/// `2xx` .. `5xx` as the metrics label.
fn status_code_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// A request that got no answer, in the user's terms, naming the target.
fn transport_failure(name: &str, timeout_ms: u64, url: &str, err: &reqwest::Error) -> Failure {
    if let Some(refused) = resolve::refusal(err) {
        return failure(
            "url",
            format!("request to {name} ({}) refused: {refused}", redact(url)),
        );
    }
    let chain = error_chain(err);
    let lower = chain.to_ascii_lowercase();
    if err.is_timeout() {
        return failure(
            "timeout",
            format!(
                "request to {name} ({}) timed out after {timeout_ms} ms (timeout_ms)",
                redact(url)
            ),
        );
    }
    let (code, what) = if lower.contains("certificate")
        || lower.contains("tls")
        || lower.contains("handshake")
        || lower.contains("unknownissuer")
    {
        ("tls", "TLS failed")
    } else if err.is_connect() {
        ("connect", "could not connect")
    } else {
        ("error", "failed")
    };
    failure(
        code,
        format!("request to {name} ({}) {what}: {chain}", redact(url)),
    )
}

fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(inner) = source {
        let s = inner.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = inner.source();
    }
    text
}

/// A URL without its query or credentials (they may hold secrets).
fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            u.set_query(None);
            // Only URLs that cannot hold credentials refuse these: nothing to remove then.
            u.set_password(None).ok();
            u.set_username("").ok();
            u.to_string()
        }
        Err(_) => "?".into(),
    }
}

/// `Retry-After`: delta-seconds or an HTTP date; `None` if neither.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The original servers' body: `{"topic","id","contents"}`, contents as text (lossy
/// for bytes that are not UTF-8).
fn seed_body(job: &Outgoing<'_>) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "topic": job.topic,
        "id": job.id,
        "contents": String::from_utf8_lossy(job.body.as_ref()),
    }))
    .unwrap_or_default()
}

/// Forwarded AMQP headers as `x-redisched-header-<name>`: text and numbers as they
/// are; other types as JSON-ish text. The job's URL is not forwarded.
fn forward(props: &AMQPProperties, map: &mut HeaderMap) {
    let Some(table) = props.headers() else {
        return;
    };
    for (key, value) in table.inner() {
        if key.as_str() == URL_HEADER {
            continue;
        }
        let text = match value {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::ShortString(s) => s.as_str().to_owned(),
            AMQPValue::Boolean(b) => b.to_string(),
            AMQPValue::ShortShortInt(n) => n.to_string(),
            AMQPValue::ShortShortUInt(n) => n.to_string(),
            AMQPValue::ShortInt(n) => n.to_string(),
            AMQPValue::ShortUInt(n) => n.to_string(),
            AMQPValue::LongInt(n) => n.to_string(),
            AMQPValue::LongUInt(n) => n.to_string(),
            AMQPValue::LongLongInt(n) => n.to_string(),
            AMQPValue::Float(n) => n.to_string(),
            AMQPValue::Double(n) => n.to_string(),
            AMQPValue::Timestamp(n) => n.to_string(),
            other => format!("{other:?}"),
        };
        let name = format!("{FORWARDED_PREFIX}{}", key.as_str().to_ascii_lowercase());
        put(map, &name, &header_safe(&text));
    }
}

/// [`header_safe`] as a header value, with no copy to a `String` for plain text.
fn header_safe_value(text: &str) -> Result<HeaderValue, reqwest::header::InvalidHeaderValue> {
    if is_plain(text) {
        HeaderValue::from_str(text)
    } else {
        HeaderValue::from_str(&header_safe(text))
    }
}

fn is_plain(text: &str) -> bool {
    text.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'%')
}

/// Text as a header value: printable ASCII as is, anything else percent-encoded.
pub fn header_safe(text: &str) -> String {
    if is_plain(text) {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric()
            || b"-._~".contains(&b)
            || ((0x20..0x7f).contains(&b) && b != b'%')
        {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("2", now), Some(Duration::from_secs(2)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(30))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn ids_that_are_not_plain_ascii_are_percent_encoded() {
        assert_eq!(header_safe("order-42"), "order-42");
        assert_eq!(header_safe("größe"), "gr%C3%B6%C3%9Fe");
        assert_eq!(header_safe("100%"), "100%25");
    }

    #[test]
    fn numbers_are_written_as_to_string_writes_them() {
        for n in [0, 7, -1, 1_796_090_000_002, i64::MAX, i64::MIN] {
            assert_eq!(decimal(n), n.to_string().as_str());
        }
        assert_eq!(decimal(u64::MAX), u64::MAX.to_string().as_str());
    }
}
