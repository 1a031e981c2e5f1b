//! Where and how spans leave: OTLP over HTTP (protobuf), batched with a bounded queue.
//!
//! The endpoint: `telemetry.otlp_endpoint`, else the standard
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as is), else `OTEL_EXPORTER_OTLP_ENDPOINT`
//! (`/v1/traces` appended); `OTEL_SDK_DISABLED=true` turns export off whatever they say.
//! The SDK's batch processor queues finished spans (at most `max_queue_size`; more are
//! dropped, a stage never waits for export) on its own thread, which posts each batch
//! through [`ExportClient`]: our reqwest client (rustls on *ring*, like the webhooks)
//! running on the bridge's runtime. At shutdown, what is queued is sent, bounded by
//! `export_timeout_ms`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;

use super::TelemetryError;
use crate::config::TelemetryConfig;

/// The standard variables read (OpenTelemetry's SDK environment variables).
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
const OTEL_EXPORTER_OTLP_CERTIFICATE: &str = "OTEL_EXPORTER_OTLP_CERTIFICATE";
const OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE: &str = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE";
const OTEL_EXPORTER_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
const OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";

/// The path OTLP/HTTP receivers take traces on, appended to a base endpoint.
const TRACES_PATH: &str = "v1/traces";
/// Spans per export request at most (the SDK's default), never above the queue.
const MAX_EXPORT_BATCH: usize = 512;
/// Export failures are logged at most this often (with a count of the others).
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);

/// Where traces go, and which setting said so (for the start-up line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub source: &'static str,
}

/// The traces endpoint in force, `None` when export is off; `env` reads a variable. An
/// unusable URL from a variable is an error naming it (the config's own key is checked
/// with the rest of the configuration).
pub fn traces_endpoint(
    configured: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Endpoint>, TelemetryError> {
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    if set(OTEL_SDK_DISABLED).is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let (url, source) = if !configured.trim().is_empty() {
        (with_traces_path(configured), "telemetry.otlp_endpoint")
    } else if let Some(url) = set(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) {
        (url.trim().to_string(), OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
    } else if let Some(url) = set(OTEL_EXPORTER_OTLP_ENDPOINT) {
        (with_traces_path(&url), OTEL_EXPORTER_OTLP_ENDPOINT)
    } else {
        return Ok(None);
    };
    match crate::urls::otlp_endpoint_problem(&url) {
        None => Ok(Some(Endpoint { url, source })),
        Some(message) => Err(TelemetryError::Export {
            key: source.to_string(),
            message,
        }),
    }
}

/// `base` with `/v1/traces` appended to its path, as the OTLP exporter specification
/// says for `OTEL_EXPORTER_OTLP_ENDPOINT`; a URL already ending in it is kept.
fn with_traces_path(base: &str) -> String {
    let base = base.trim();
    if base.trim_end_matches('/').ends_with(TRACES_PATH) {
        return base.to_string();
    }
    match url::Url::parse(base) {
        Ok(mut url) if url.has_host() => {
            let path = format!("{}/{TRACES_PATH}", url.path().trim_end_matches('/'));
            url.set_path(&path);
            url.to_string()
        }
        // Not a URL: left for the check to refuse in the user's words.
        _ => base.to_string(),
    }
}

/// A running exporter: the tracer provider and how long its flush may take.
#[derive(Debug)]
pub(super) struct Exporting {
    provider: SdkTracerProvider,
    timeout: Duration,
}

impl Exporting {
    /// Builds the exporter, the batch processor and the provider (parent-based ratio
    /// sampling). Needs the tokio runtime: export requests run on it.
    pub(super) fn start(
        config: &TelemetryConfig,
        endpoint: &Endpoint,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TelemetryError> {
        let fail = |key: &str, message: String| TelemetryError::Export {
            key: key.to_string(),
            message,
        };
        for name in [
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
            OTEL_EXPORTER_OTLP_PROTOCOL,
        ] {
            if let Some(protocol) = env(name).filter(|p| p.trim() != "http/protobuf") {
                return Err(fail(
                    name,
                    format!("{protocol:?}: redisched exports over http/protobuf only"),
                ));
            }
        }
        let timeout = Duration::from_millis(config.export_timeout_ms);
        let ca_file = env(OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE)
            .or_else(|| env(OTEL_EXPORTER_OTLP_CERTIFICATE))
            .filter(|f| !f.trim().is_empty());
        let client = ExportClient::new(timeout, ca_file.as_deref())
            .map_err(|e| fail("telemetry.otlp_endpoint", e))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint.url.clone())
            .with_timeout(timeout)
            .build()
            .map_err(|e| fail(endpoint.source, e.to_string()))?;
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(config.max_queue_size)
            .with_max_export_batch_size(MAX_EXPORT_BATCH.min(config.max_queue_size))
            .with_scheduled_delay(Duration::from_millis(config.batch_delay_ms))
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        // `Resource::builder` also reads OTEL_RESOURCE_ATTRIBUTES; the name is ours.
        let resource = Resource::builder()
            .with_service_name(config.service_name.clone())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler(config.sampling_ratio))
            .with_resource(resource)
            .build();
        Ok(Self { provider, timeout })
    }

    pub(super) fn tracer(&self) -> SdkTracer {
        self.provider.tracer("redisched")
    }
}

/// A producer's decision when it sent one, else `ratio` of new traces.
pub(super) fn sampler(ratio: f64) -> Sampler {
    Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
}

/// What [`super::init`] installed: an exporter to flush at shutdown, or nothing.
#[derive(Debug)]
pub struct Telemetry {
    exporting: Option<Exporting>,
}

impl Telemetry {
    pub(super) fn off() -> Self {
        Self { exporting: None }
    }

    pub(super) fn on(exporting: Exporting) -> Self {
        Self {
            exporting: Some(exporting),
        }
    }

    /// Whether spans are exported.
    pub fn is_on(&self) -> bool {
        self.exporting.is_some()
    }

    /// Sends the spans still queued (within `export_timeout_ms`) and stops the exporter.
    /// Call after the bridge stopped, inside the runtime.
    pub async fn shutdown(self) {
        let Some(Exporting { provider, timeout }) = self.exporting else {
            return;
        };
        // The SDK blocks until its thread has sent the last batch through the runtime.
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(timeout));
        match done.await {
            Ok(Ok(())) => tracing::info!("trace export flushed"),
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "trace export: the last spans may be lost")
            }
            Err(err) => tracing::warn!(error = %err, "trace export: cannot flush"),
        }
    }
}

/// The exporter's HTTP client: reqwest on the bridge's runtime (the SDK's batch thread
/// has none), rustls on *ring* with the system roots (plus the standard certificate
/// variable's CAs). Failures are logged, at most once a minute with a count.
#[derive(Debug)]
pub(super) struct ExportClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
    failures: Arc<Failures>,
}

#[derive(Debug)]
struct Failures {
    since_logged: AtomicU64,
    last_logged: std::sync::Mutex<Option<Instant>>,
}

impl ExportClient {
    pub(super) fn new(timeout: Duration, ca_file: Option<&str>) -> Result<Self, String> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| "trace export needs the async runtime".to_string())?;
        #[allow(unused_mut)] // TLS is configured only with the `tls` feature
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none());
        #[cfg(feature = "tls")]
        {
            let tls = crate::tls::http_tls_config(ca_file.map(std::path::Path::new))
                .map_err(|e| format!("{OTEL_EXPORTER_OTLP_CERTIFICATE}: {e}"))?;
            builder = builder.use_preconfigured_tls(tls);
        }
        #[cfg(not(feature = "tls"))]
        if ca_file.is_some() {
            return Err(format!(
                "{OTEL_EXPORTER_OTLP_CERTIFICATE} needs a build with the `tls` feature"
            ));
        }
        let client = builder
            .build()
            .map_err(|e| format!("cannot build the export client: {e}"))?;
        Ok(Self {
            client,
            runtime,
            failures: Arc::new(Failures {
                since_logged: AtomicU64::new(0),
                last_logged: std::sync::Mutex::new(None),
            }),
        })
    }

    async fn post(
        client: reqwest::Client,
        request: reqwest::Request,
    ) -> Result<Response<Bytes>, HttpError> {
        let response = client.execute(request).await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        let mut answer = Response::builder().status(status).body(body)?;
        *answer.headers_mut() = headers;
        Ok(answer)
    }
}

impl Failures {
    fn note(&self, what: &str) {
        let missed = self.since_logged.fetch_add(1, Ordering::Relaxed);
        let Ok(mut last) = self.last_logged.lock() else {
            return;
        };
        if last.is_some_and(|at| at.elapsed() < FAILURE_LOG_EVERY) {
            return;
        }
        *last = Some(Instant::now());
        self.since_logged.store(0, Ordering::Relaxed);
        tracing::warn!(
            error = what,
            failed_before = missed,
            "trace export failed; spans of this batch are lost (the bridge goes on)"
        );
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let task = self.runtime.spawn(Self::post(self.client.clone(), request));
        let result = match task.await {
            Ok(result) => result,
            Err(err) => Err(err.into()),
        };
        match &result {
            Ok(answer) if !answer.status().is_success() => self
                .failures
                .note(&format!("the receiver answered {}", answer.status())),
            Ok(_) => {}
            Err(err) => self.failures.note(&err.to_string()),
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_endpoint_comes_from_the_config_then_the_standard_variables() {
        let url = |configured: &str, env: &[(&str, &str)]| {
            traces_endpoint(configured, vars(env))
                .expect("valid")
                .map(|e| (e.url, e.source))
        };
        assert_eq!(url("", &[]), None, "off by default");
        assert_eq!(
            url("http://collector:4318", &[]),
            Some((
                "http://collector:4318/v1/traces".into(),
                "telemetry.otlp_endpoint"
            ))
        );
        let standard = [(OTEL_EXPORTER_OTLP_ENDPOINT, "https://otlp.example/base/")];
        assert_eq!(
            url("http://collector:4318/v1/traces", &standard),
            Some((
                "http://collector:4318/v1/traces".into(),
                "telemetry.otlp_endpoint"
            )),
            "the config wins; a full traces URL is kept"
        );
        assert_eq!(
            url("", &standard),
            Some((
                "https://otlp.example/base/v1/traces".into(),
                OTEL_EXPORTER_OTLP_ENDPOINT
            ))
        );
        let both = [
            (OTEL_EXPORTER_OTLP_ENDPOINT, "http://a:4318"),
            (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "http://b:9999/custom"),
        ];
        assert_eq!(
            url("", &both),
            Some((
                "http://b:9999/custom".into(),
                OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
            )),
            "the per-signal variable is used as is"
        );
        assert_eq!(url("", &[(OTEL_EXPORTER_OTLP_ENDPOINT, " ")]), None);
        let disabled = [
            (OTEL_EXPORTER_OTLP_ENDPOINT, "http://a:4318"),
            (OTEL_SDK_DISABLED, "TRUE"),
        ];
        assert_eq!(url("http://c:4318", &disabled), None);
        let err = traces_endpoint("", vars(&[(OTEL_EXPORTER_OTLP_ENDPOINT, "collector:4318")]))
            .expect_err("not a URL");
        assert!(
            err.to_string()
                .starts_with("OTEL_EXPORTER_OTLP_ENDPOINT: expected an http"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_protocol_other_than_http_protobuf_is_refused_by_name() {
        let endpoint = Endpoint {
            url: "http://127.0.0.1:1/v1/traces".into(),
            source: "telemetry.otlp_endpoint",
        };
        let err = Exporting::start(
            &TelemetryConfig::default(),
            &endpoint,
            vars(&[(OTEL_EXPORTER_OTLP_PROTOCOL, "grpc")]),
        )
        .expect_err("grpc is not spoken");
        assert!(
            err.to_string().contains("OTEL_EXPORTER_OTLP_PROTOCOL"),
            "{err}"
        );
        let ok = Exporting::start(
            &TelemetryConfig::default(),
            &endpoint,
            vars(&[(OTEL_EXPORTER_OTLP_PROTOCOL, "http/protobuf")]),
        )
        .expect("http/protobuf is");
        Telemetry::on(ok).shutdown().await;
    }
}
