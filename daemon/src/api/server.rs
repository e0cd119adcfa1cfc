//! The control API's server: an axum router over the node's read side, on loopback only.
//! Everything but `POST /leave` only reads.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::Html;
use axum::routing;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::metrics;
use crate::readout::Readout;

/// The status page; it loads nothing but `/status` and `/history` from this API.
const STATUS_PAGE: &str = include_str!("status.html");

/// What the handlers read: the node's read side, the registry that `/metrics` encodes, and
/// the token that `POST /leave` cancels.
#[derive(Debug)]
struct Api {
    node: Readout,
    metrics: Registry,
    leave: CancellationToken,
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
                api.leave.cancel();
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

/// Serves the API of the node that `node` reads until `leave` is cancelled (which
/// `POST /leave` does); `/metrics` encodes `metrics`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    node: Readout,
    metrics: Registry,
    leave: CancellationToken,
) -> Result<()> {
    let stop = leave.clone();
    let api = Arc::new(Api {
        node,
        metrics,
        leave,
    });
    axum::serve(listener, router(api))
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
        .context("control API failed")
}
