//! A target's HTTP client: the call (one POST of the request `delivery.rs` prepares, to
//! the target's URL or the job's own one, checked again and connected to through the
//! address guard of `resolve.rs`) and what its answer means ([`Delivered`], or a
//! [`Failure`] with its metrics code, `last_error` text and `Retry-After`; and, for the
//! target's breaker, an [`Outcome`]). It knows nothing of Redis or of dispatch.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use hyper::body::Bytes;
use lapin::protocol::basic::AMQPProperties;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER, USER_AGENT};

use super::resolve;
use crate::job::meta::own_url;
use crate::targets::TargetConfig;

/// How much of a 2xx answer's body is read (and dropped) to keep the connection.
const SUCCESS_BODY_BYTES: usize = 64 * 1024;
/// How much of a failed response's body `last_error` quotes.
const ERROR_BODY_BYTES: usize = 200;

/// A failed attempt: the metrics code, the `last_error` text, and a `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    /// `4xx`, `5xx`, `timeout`, `connect`, `tls` (or `3xx`, `1xx`, `url`, `error`).
    pub(super) code: &'static str,
    /// The HTTP status, when there was an answer.
    pub(super) status: Option<u16>,
    pub(super) reason: String,
    pub(super) retry_after: Option<Duration>,
}

/// What a 2xx answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Delivered {
    pub(super) status: u16,
}

/// What one request to the target's own URL says of its health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Outcome {
    Ok,
    /// A 5xx, a 429, a timeout, no connection.
    Failed(String),
    /// 410 Gone.
    Gone(String),
}

/// What a request's result says of its target's health (the book's *Target health*
/// defines it): any other answer is the target's own, healthy, reply.
pub(super) fn judge(result: &Result<Delivered, Failure>) -> Outcome {
    match result {
        Ok(_) => Outcome::Ok,
        Err(f) if f.status == Some(410) => Outcome::Gone(f.reason.clone()),
        Err(f)
            if f.status == Some(429) || matches!(f.code, "5xx" | "timeout" | "connect" | "tls") =>
        {
            Outcome::Failed(f.reason.clone())
        }
        Err(_) => Outcome::Ok,
    }
}

/// `User-Agent` of every request: `redisched/<version>`.
const USER_AGENT_VALUE: &str = concat!("redisched/", env!("CARGO_PKG_VERSION"));

impl Failure {
    /// A failure no retry can mend: the job's own URL is refused by the guard (or no
    /// longer allowed by the target's configuration). Its job is parked at once, to be
    /// re-driven once the cause is fixed.
    pub(super) fn is_refusal(&self) -> bool {
        self.code == "url"
    }
}

/// A target's client: pooled keep-alive connections, HTTP/2 when the server offers it
/// (ALPN), no redirects, `HTTPS_PROXY` / `NO_PROXY` from the environment.
#[derive(Debug, Clone)]
pub(super) struct Client {
    http: reqwest::Client,
    /// The client of jobs' own URLs, unless the target allows private ones: its
    /// resolver keeps only global addresses, and it connects directly (a proxy would
    /// resolve the name where the guard cannot see the address).
    guarded: Option<reqwest::Client>,
    pub(super) target: Arc<TargetConfig>,
    /// Each signing secret's key and when it stops signing (epoch ms; `None`: never),
    /// decoded once: a request signs with those still valid at its time.
    keys: Arc<Vec<(Vec<u8>, Option<i64>)>>,
    extra: HeaderMap,
    /// The target's URL, parsed once: the common case (no per-job URL) then costs no
    /// parse (with its IDNA pass) per request.
    url: reqwest::Url,
}

impl Client {
    pub(super) fn new(target: TargetConfig) -> Result<Self, String> {
        let http = http_client(&target, false)?;
        let guarded = (!target.allowed_url_prefixes.is_empty() && !target.allow_private_job_urls)
            .then(|| http_client(&target, true))
            .transpose()?;
        let keys = target
            .signing_secrets
            .iter()
            .map(|s| crate::targets::secret_key(s).map(|key| (key, s.expires_at_ms())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("target {}: {e}", target.name))?;
        // Who is calling (some proxies and WAFs refuse a request without it); the
        // target's own `headers` may say otherwise.
        let mut extra = HeaderMap::new();
        extra.insert(USER_AGENT, HeaderValue::from_static(USER_AGENT_VALUE));
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

    /// The headers every request starts from: `User-Agent` and the target's own.
    pub(super) fn extra(&self) -> &HeaderMap {
        &self.extra
    }

    /// The signing secrets' keys still valid now.
    pub(super) fn signing_keys(&self) -> Vec<&[u8]> {
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.keys
            .iter()
            .filter(|(_, until)| until.is_none_or(|until| now_ms < until))
            .map(|(key, _)| key.as_slice())
            .collect()
    }

    /// POSTs one job's prepared request (`props`: the job's stored properties, which
    /// may name its own URL) and says what came of it; also returns how long it took,
    /// and whether it was meant for the target's own URL rather than a job's own (only
    /// those answers tell of the target's health).
    pub(super) async fn post(
        &self,
        props: &AMQPProperties,
        headers: HeaderMap,
        body: Bytes,
    ) -> (Result<Delivered, Failure>, Duration, bool) {
        let started = Instant::now();
        let own = own_url(props);
        let to_target = !matches!(own, Ok(Some(_)));
        let result = self.try_post(own, headers, body).await;
        (result, started.elapsed(), to_target)
    }

    async fn try_post(
        &self,
        own: Result<Option<String>, String>,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Delivered, Failure> {
        let name = &self.target.name;
        // A job's own URL is checked again here (the configuration may have changed
        // since ingest), and what is requested is exactly the URL that was checked.
        let (parsed, http, own) = match own.map_err(|r| failure("url", r))? {
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
        // Built whole rather than through `RequestBuilder`, which would copy the
        // headers over one by one into a map of its own.
        let mut post = reqwest::Request::new(reqwest::Method::POST, parsed);
        *post.headers_mut() = headers;
        *post.body_mut() = Some(body.into());
        let response = http
            .execute(post)
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

fn failure(code: &'static str, reason: String) -> Failure {
    Failure {
        code,
        status: None,
        reason,
        retry_after: None,
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
fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(code: &'static str, status: Option<u16>) -> Result<Delivered, Failure> {
        Err(Failure {
            code,
            status,
            reason: "r".into(),
            retry_after: None,
        })
    }

    #[test]
    fn a_failure_is_a_5xx_a_429_a_timeout_or_no_connection() {
        assert_eq!(judge(&Ok(Delivered { status: 200 })), Outcome::Ok);
        for (code, status) in [
            ("5xx", Some(503)),
            ("4xx", Some(429)),
            ("timeout", None),
            ("connect", None),
            ("tls", None),
        ] {
            assert!(
                matches!(judge(&failure(code, status)), Outcome::Failed(_)),
                "{code}"
            );
        }
        assert!(matches!(
            judge(&failure("4xx", Some(410))),
            Outcome::Gone(_)
        ));
        assert_eq!(
            judge(&failure("4xx", Some(404))),
            Outcome::Ok,
            "it answered"
        );
    }

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
}
