//! The exposition formats: which one a scraper asks for (`Accept`), and the classic text
//! format 0.0.4 derived from the OpenMetrics text prometheus-client writes.

use std::fmt::Write as _;

use super::Metrics;

/// The exposition formats `GET /metrics` speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The classic Prometheus text format 0.0.4 (what `promtool check metrics` reads).
    Classic,
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
}

impl Format {
    /// Picks the format from an `Accept` header: OpenMetrics when the client asks for
    /// `application/openmetrics-text` at least as much as for plain text; the classic
    /// format otherwise, and when there is no header or it is unreadable.
    pub fn from_accept(accept: Option<&str>) -> Self {
        let (mut open_metrics, mut plain) = (0.0_f32, 0.0_f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let quality = parts
                .filter_map(|param| param.split_once('='))
                .find(|(key, _)| key.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, value)| value.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => open_metrics = open_metrics.max(quality),
                "text/plain" | "text/*" | "*/*" => plain = plain.max(quality),
                _ => {}
            }
        }
        if open_metrics > 0.0 && open_metrics >= plain {
            Format::OpenMetrics
        } else {
            Format::Classic
        }
    }

    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Classic => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

impl Metrics {
    /// Everything in OpenMetrics text.
    pub fn encode(&self) -> String {
        self.encode_as(Format::OpenMetrics)
    }

    /// Everything (the registry and the per-topic snapshot) in `format`.
    pub fn encode_as(&self, format: Format) -> String {
        let mut open_metrics = String::new();
        // Writing into a String cannot fail.
        prometheus_client::encoding::text::encode_registry(&mut open_metrics, &self.registry).ok();
        let mut out = match format {
            Format::OpenMetrics => open_metrics,
            Format::Classic => classic_from_open_metrics(&open_metrics),
        };
        self.encode_topics(&mut out);
        if format == Format::OpenMetrics {
            out.push_str("# EOF\n");
        }
        out
    }
}

/// Rewrites prometheus-client's OpenMetrics text (it writes no other text format) into
/// the classic format 0.0.4: there a counter's HELP and TYPE name its samples, which end
/// in `_total`; OpenMetrics names the family without the suffix. `# UNIT` and `# EOF`
/// have no classic counterpart. Samples are the same lines in both (no exemplars here).
fn classic_from_open_metrics(open_metrics: &str) -> String {
    let mut out = String::with_capacity(open_metrics.len() + 256);
    let mut help: Option<(&str, &str)> = None;
    for line in open_metrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = rest.split_once(' ');
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let Some((family, kind)) = rest.split_once(' ') else {
                continue;
            };
            let (name, kind) = match kind {
                "counter" => (format!("{family}_total"), "counter"),
                "info" => (format!("{family}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (family.to_string(), kind),
                _ => (family.to_string(), "untyped"),
            };
            if let Some((_, text)) = help.take().filter(|(named, _)| *named == family) {
                writeln!(out, "# HELP {name} {text}").ok();
            }
            writeln!(out, "# TYPE {name} {kind}").ok();
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_picks_the_format() {
        let cases = [
            (None, Format::Classic),
            (Some(""), Format::Classic),
            (Some("*/*"), Format::Classic),
            (Some("text/plain;version=0.0.4"), Format::Classic),
            (Some("application/openmetrics-text"), Format::OpenMetrics),
            // What Prometheus itself sends.
            (
                Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
                Format::OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;q=0.3, text/plain"),
                Format::Classic,
            ),
            (Some("application/openmetrics-text;q=0"), Format::Classic),
            (Some("Application/OpenMetrics-Text; q=0.9"), Format::OpenMetrics),
            (Some("application/json"), Format::Classic),
        ];
        for (accept, want) in cases {
            assert_eq!(Format::from_accept(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn classic_names_counters_by_their_samples() {
        let metrics = Metrics::new();
        let classic = metrics.encode_as(Format::Classic);
        assert!(
            classic.contains("# HELP redisched_jobs_dispatched_total "),
            "{classic}"
        );
        assert!(
            classic.contains("# TYPE redisched_jobs_dispatched_total counter\n"),
            "{classic}"
        );
        assert!(
            classic.contains("redisched_jobs_dispatched_total 0\n"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"), "{classic}");
        let open = metrics.encode_as(Format::OpenMetrics);
        assert!(
            open.contains("# TYPE redisched_jobs_dispatched counter\n"),
            "{open}"
        );
        assert!(open.ends_with("# EOF\n"), "{open}");
    }
}
