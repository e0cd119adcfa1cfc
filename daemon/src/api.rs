//! The control API: HTTP+JSON on a loopback address only, written to `<data-dir>/api` so that
//! `nodectl status | peers | wait | leave` find the daemon of a data dir.
//!
//! - `GET /`: the status page (peer table, loss and accuracy curves), built into the binary.
//! - `GET /history`: the loss curve and every test evaluation ([`HistoryReport`]).
//! - `GET /status`: this node's progress and view of the run ([`StatusReport`]).
//! - `GET /peers`: the live peers with their steps ([`PeerReport`]).
//! - `GET /metrics`: Murmur's and libp2p's metrics as Prometheus text ([`crate::metrics`]).
//! - `POST /leave`: leave the run gracefully (checkpoint, goodbye heartbeat, exit 0).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::Html;
use axum::routing;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::metrics;
use crate::node::NodeState;
use crate::store::DataDir;

/// `GET /status`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusReport {
    pub peer_id: String,
    pub run_id: String,
    pub fingerprint: String,
    pub model: String,
    /// The device the replica trains on (`cpu`, `cuda:0`).
    #[serde(default)]
    pub device: String,
    /// `training`, `finished` or `leaving`.
    pub state: String,
    pub step: u64,
    pub epoch: u64,
    pub epochs: u64,
    pub loss_ema: f32,
    pub test_accuracy: Option<f64>,
    pub samples_seen: u64,
    pub live_peers: usize,
    /// The live peers, as `GET /peers` lists them.
    #[serde(default)]
    pub peers: Vec<PeerReport>,
    pub listen: Vec<String>,
    pub rejected_messages: u64,
    /// Tensor bytes received in valid frames.
    pub tensor_bytes_in: u64,
    pub blocked_peers: usize,
    pub uptime_s: f64,
    /// When the daemon started, in seconds since the Unix epoch.
    pub started_unix_s: f64,
    /// Every test evaluation so far.
    pub history: Vec<crate::node::AccuracyPoint>,
    pub sync: crate::sync::SyncReport,
}

/// One entry of `GET /peers`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerReport {
    pub peer_id: String,
    pub step: u64,
    pub epoch: u64,
    pub loss_ema: f32,
    pub samples_seen: u64,
    pub mode: String,
    pub role: String,
    pub last_seen_ms: u64,
    /// This node's step minus the peer's: how far the peer's replica lags behind ours
    /// (negative when it is ahead).
    #[serde(default)]
    pub staleness: i64,
}

/// `GET /history`: what the status page plots.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HistoryReport {
    /// The training loss, thinned to at most [`crate::node::LossCurve::CAPACITY`] points.
    pub loss: Vec<crate::node::LossPoint>,
    /// Every test evaluation.
    pub accuracy: Vec<crate::node::AccuracyPoint>,
}

/// The status page; it loads nothing but `/status` and `/history` from this API.
const STATUS_PAGE: &str = include_str!("api/status.html");

/// What the handlers read: the node, and the registry that `/metrics` encodes.
#[derive(Debug)]
struct Api {
    node: Arc<NodeState>,
    metrics: Registry,
}

fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route("/", routing::get(|| async { Html(STATUS_PAGE) }))
        .route(
            "/history",
            routing::get(|State(api): State<Arc<Api>>| async move { Json(api.node.history()) }),
        )
        .route(
            "/status",
            routing::get(|State(api): State<Arc<Api>>| async move { Json(api.node.status()) }),
        )
        .route(
            "/peers",
            routing::get(|State(api): State<Arc<Api>>| async move { Json(api.node.peers()) }),
        )
        .route(
            "/metrics",
            routing::get(
                |State(api): State<Arc<Api>>, headers: HeaderMap| async move {
                    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
                    let format = metrics::Format::negotiate(accept);
                    (
                        [(header::CONTENT_TYPE, format.content_type())],
                        metrics::encode(&api.metrics, format),
                    )
                },
            ),
        )
        .route(
            "/leave",
            routing::post(|State(api): State<Arc<Api>>| async move {
                api.node.request_shutdown();
                Json(serde_json::json!({"leaving": true}))
            }),
        )
        .with_state(api)
}

/// Binds the API on `addr`, which must be a loopback address.
pub async fn bind(addr: &str) -> Result<tokio::net::TcpListener> {
    let parsed: SocketAddr = addr
        .parse()
        .with_context(|| format!("--api `{addr}` is not an address like 127.0.0.1:7300"))?;
    if !parsed.ip().is_loopback() {
        bail!(
            "--api `{addr}` is not a loopback address; the control API only listens on 127.0.0.1 or ::1"
        );
    }
    tokio::net::TcpListener::bind(parsed)
        .await
        .with_context(|| format!("cannot listen on `{addr}` for the control API"))
}

/// Serves the API until `state` asks for shutdown; `/metrics` encodes `metrics`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<NodeState>,
    metrics: Registry,
) -> Result<()> {
    let mut stop = state.shutdown_signal();
    let api = Arc::new(Api {
        node: state,
        metrics,
    });
    axum::serve(listener, router(api))
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|stop| *stop).await;
        })
        .await
        .context("control API failed")
}

/// The API address of the daemon that owns `data`.
pub fn address(data: &DataDir) -> Result<String> {
    let path = data.api_path();
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no daemon is running for `{}` (no `{}`): start one with `nodectl join`, or pass \
             the right `--data-dir`",
            data.root().display(),
            path.display()
        )
    })?;
    Ok(text.trim().to_owned())
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into()
}

/// `GET http://<addr><path>` as JSON.
pub fn get_json<T: DeserializeOwned>(addr: &str, path: &str) -> Result<T> {
    agent()
        .get(format!("http://{addr}{path}"))
        .call()
        .with_context(|| {
            format!("the daemon at {addr} did not answer `GET {path}`; is it running?")
        })?
        .body_mut()
        .read_json()
        .with_context(|| format!("the daemon at {addr} sent an unreadable `{path}`"))
}

/// `POST http://<addr><path>` with an empty body.
pub fn post(addr: &str, path: &str) -> Result<()> {
    agent()
        .post(format!("http://{addr}{path}"))
        .send_empty()
        .with_context(|| format!("the daemon at {addr} did not answer `POST {path}`"))?;
    Ok(())
}
