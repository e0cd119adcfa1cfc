//! OpenTelemetry export over OTLP/HTTP: the node's metrics and its spans (an exchange, a ring
//! round, a state sync, a checkpoint), sent to a collector when `OTEL_EXPORTER_OTLP_ENDPOINT`
//! or `[telemetry] otlp_endpoint` in the node config names one.
//!
//! Nothing is set up without an endpoint: the global meter stays OpenTelemetry's no-op, and no
//! span reaches an exporter, so a node without telemetry pays nothing for it. The metrics are
//! [`metrics::readings`], the list `/metrics` serves, read by observable instruments at each
//! export; the spans are `tracing` spans, which `tracing-opentelemetry` turns into OTLP spans.
//! [`Telemetry::shutdown`] flushes both before the process exits.

use std::borrow::Cow;

use anyhow::{Context, Result};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Meter, ObservableCounter, ObservableGauge};
use opentelemetry::trace::TracerProvider;
use opentelemetry_otlp::{MetricExporter, Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

use crate::metrics::{self, Kind};
use crate::readout::Readout;
pub use crate::readout::{SCOPE, otel_name};

/// The standard variable that names the collector (`http://127.0.0.1:4318`).
pub const ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// Where telemetry goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (and the other standard `OTEL_*` variables) decide.
    Environment(String),
    /// The node config's base URL; `/v1/traces` and `/v1/metrics` are appended.
    Configured(String),
}

impl Endpoint {
    /// The standard variable wins over the node config; `None` when neither names one.
    pub fn resolve(configured: Option<&str>) -> Option<Endpoint> {
        let from_env = std::env::var(ENDPOINT_VAR)
            .ok()
            .filter(|url| !url.trim().is_empty());
        match (from_env, configured) {
            (Some(url), _) => Some(Endpoint::Environment(url)),
            (None, Some(url)) if !url.trim().is_empty() => {
                Some(Endpoint::Configured(url.trim_end_matches('/').to_owned()))
            }
            _ => None,
        }
    }

    fn url(&self) -> &str {
        match self {
            Endpoint::Environment(url) | Endpoint::Configured(url) => url,
        }
    }
}

/// The exporters of a running node; [`Telemetry::shutdown`] flushes them.
#[derive(Debug)]
pub struct Telemetry {
    traces: SdkTracerProvider,
    metrics: SdkMeterProvider,
    endpoint: String,
}

impl Telemetry {
    /// Starts the span and metric exporters towards `endpoint` and makes the metric exporter
    /// the global meter provider. `instance` (the peer id) tells nodes apart in the collector.
    ///
    /// Call outside any async runtime: the exporters run on their own threads.
    pub fn start(endpoint: &Endpoint, instance: Option<&str>) -> Result<Telemetry> {
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name("murmur");
        }
        if let Some(instance) = instance {
            resource =
                resource.with_attribute(KeyValue::new("service.instance.id", instance.to_owned()));
        }
        let resource = resource.build();

        let mut spans = SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary);
        let mut readings = MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary);
        if let Endpoint::Configured(base) = endpoint {
            spans = spans.with_endpoint(format!("{base}/v1/traces"));
            readings = readings.with_endpoint(format!("{base}/v1/metrics"));
        }
        let spans = spans.build().with_context(|| {
            format!(
                "cannot set up the OTLP span exporter for {}",
                endpoint.url()
            )
        })?;
        let readings = readings.build().with_context(|| {
            format!(
                "cannot set up the OTLP metric exporter for {}",
                endpoint.url()
            )
        })?;

        let traces = SdkTracerProvider::builder()
            .with_batch_exporter(spans)
            .with_resource(resource.clone())
            .build();
        // The export interval is OTEL_METRIC_EXPORT_INTERVAL (60 s by default).
        let metrics = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(readings).build())
            .with_resource(resource)
            .build();
        opentelemetry::global::set_meter_provider(metrics.clone());
        Ok(Telemetry {
            traces,
            metrics,
            endpoint: endpoint.url().to_owned(),
        })
    }

    /// The tracer that `tracing-opentelemetry` hands the node's spans to.
    pub fn tracer(&self) -> SdkTracer {
        self.traces.tracer(SCOPE)
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Exports what is still buffered (the last spans, a final reading of every metric) and
    /// stops the exporters. Failures are reported, not fatal: the run itself is over.
    pub fn shutdown(self) {
        if let Err(e) = self.traces.shutdown() {
            eprintln!(
                "warning: the last spans may not have reached {}: {e}",
                self.endpoint
            );
        }
        if let Err(e) = self.metrics.shutdown() {
            eprintln!(
                "warning: the last metrics may not have reached {}: {e}",
                self.endpoint
            );
        }
    }
}

/// Instruments that keep reporting `state` while they are alive.
#[derive(Debug, Default)]
pub struct NodeInstruments {
    counters: Vec<ObservableCounter<f64>>,
    gauges: Vec<ObservableGauge<f64>>,
}

/// Registers Murmur's readings (and the ring bus bandwidth) with the global meter: one
/// observable instrument per metric, read at each export. With no exporter set up (no
/// endpoint) the global meter is a no-op and the callbacks never run.
pub fn observe(node: &Readout) -> NodeInstruments {
    let meter = opentelemetry::global::meter(SCOPE);
    let mut instruments = NodeInstruments::default();
    let mut families = metrics::readings(node);
    families.dedup_by_key(|reading| reading.name);
    for family in families {
        let name = family.name;
        let reader = node.clone();
        let callback = move |observe: &dyn Fn(f64, &[KeyValue])| {
            for reading in metrics::readings(&reader).iter().filter(|r| r.name == name) {
                if let Some(value) = reading.value {
                    let labels: Vec<KeyValue> = reading
                        .label
                        .iter()
                        .map(|(key, value)| KeyValue::new(*key, value.clone()))
                        .collect();
                    observe(value, &labels);
                }
            }
        };
        match family.kind {
            Kind::Counter => instruments.counters.push(
                meter
                    .f64_observable_counter(otel_name(name))
                    .with_description(family.help)
                    .with_callback(move |o| callback(&|v, a| o.observe(v, a)))
                    .build(),
            ),
            Kind::Gauge => {
                instruments
                    .gauges
                    .push(gauge(&meter, otel_name(name), family.help, move |o| {
                        callback(o)
                    }))
            }
        }
    }
    let bandwidth = node.clone();
    instruments.gauges.push(gauge(
        &meter,
        otel_name("ring_bus_bandwidth_bytes_per_second"),
        "Bus bandwidth of the last ring all-reduce round: algorithm bandwidth times 2(p-1)/p",
        move |observe| {
            let value = bandwidth.timings().ring_bus_bandwidth.get();
            if value > 0.0 {
                observe(value, &[]);
            }
        },
    ));
    instruments
}

fn gauge(
    meter: &Meter,
    name: String,
    help: &'static str,
    read: impl Fn(&dyn Fn(f64, &[KeyValue])) + Send + Sync + 'static,
) -> ObservableGauge<f64> {
    meter
        .f64_observable_gauge(name)
        .with_description(Cow::Borrowed(help))
        .with_callback(move |o| read(&|v, a| o.observe(v, a)))
        .build()
}

/// Installs the process's logging: `filter` (`info`, `debug`, `info,murmur_protocol=debug`) on
/// standard error as text or JSON lines, and Murmur's spans to the OTLP collector when
/// `telemetry` exports. Once per process (`nodectl`'s `main`, or the Python package's first
/// `murmur.join`).
pub fn init_logging(
    filter: &str,
    format: crate::cli::LogFormat,
    telemetry: Option<&Telemetry>,
) -> anyhow::Result<()> {
    use std::io::IsTerminal;

    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::prelude::*;
    let targets: Targets = filter.parse().map_err(|e| {
        anyhow::anyhow!("--log `{filter}` is not a log filter ({e}); try `info` or `debug`")
    })?;
    // Murmur's own spans (exchange, ring_round, state_sync, checkpoint) go to the collector
    // whatever `--log` says; libp2p's are left out.
    let spans = telemetry.map(|telemetry| {
        tracing_opentelemetry::layer()
            .with_tracer(telemetry.tracer())
            .with_filter(
                Targets::new()
                    .with_target("murmur_daemon", tracing::Level::INFO)
                    .with_target("murmur_protocol", tracing::Level::INFO),
            )
    });
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let layer = match format {
        crate::cli::LogFormat::Text => layer.with_ansi(std::io::stderr().is_terminal()).boxed(),
        // One object per line, the event's fields at the top level next to `level` and
        // `timestamp`, for log shippers and scripts.
        crate::cli::LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(layer.with_filter(targets))
        .with(spans)
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot install logging: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_names_become_dotted_names_without_total() {
        assert_eq!(otel_name("exchanges_total"), "murmur.exchanges");
        assert_eq!(otel_name("sent_bytes_total"), "murmur.sent_bytes");
        assert_eq!(otel_name("live_peers"), "murmur.live_peers");
    }

    #[test]
    fn a_configured_endpoint_is_a_base_url() {
        // The variable is unset in this test process unless a developer exported it.
        if std::env::var_os(ENDPOINT_VAR).is_some() {
            return;
        }
        assert_eq!(
            Endpoint::resolve(Some("http://127.0.0.1:4318/")),
            Some(Endpoint::Configured("http://127.0.0.1:4318".into()))
        );
        assert_eq!(Endpoint::resolve(Some(" ")), None);
        assert_eq!(Endpoint::resolve(None), None);
    }
}
