//! The control API's server: an axum router over the node's read side, on loopback only.
//! Everything but `POST /leave` only reads. Every request must name a loopback host and come
//! from no web page but the status page; a request that changes anything must carry the token
//! of `<data-dir>/api-token` (decision 0038).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::metrics;
use crate::readout::Readout;

/// The status page; it loads nothing but `/status` and `/history` from this API.
const STATUS_PAGE: &str = include_str!("status.html");

/// What the handlers read: the node's read side, the registry that `/metrics` encodes, the
/// token that `POST /leave` cancels, and the secret that requests changing anything carry.
#[derive(Debug)]
struct Api {
    node: Readout,
    metrics: Registry,
    leave: CancellationToken,
    secret: String,
}

/// A refusal with a JSON body that says what to do.
fn refuse(status: StatusCode, error: &str) -> Response {
    (status, Json(serde_json::json!({ "error": error }))).into_response()
}

/// Whether `host` (a `Host` header or the authority of an `Origin`) names this machine's
/// loopback: a name a web page could make resolve here (DNS rebinding) does not.
fn is_loopback_host(host: &str) -> bool {
    // `[::1]:7300`, `127.0.0.1:7300`, `localhost:7300`, or a bare name or address.
    let name = match host.strip_prefix('[') {
        Some(bracketed) => bracketed.split_once(']').map_or("", |(ip, _)| ip),
        None if host.matches(':').count() == 1 => host.split_once(':').map_or(host, |(n, _)| n),
        None => host,
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Compares in time independent of where the texts differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The checks every request passes before its handler: a loopback `Host`, an `Origin` (sent
/// by browsers) that is this API's own, and the token on anything but a read.
async fn guard(State(api): State<Arc<Api>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let Some(host) = host.filter(|h| is_loopback_host(h)) else {
        return refuse(
            StatusCode::FORBIDDEN,
            "the control API answers only requests addressed to a loopback host \
             (127.0.0.1, [::1] or localhost)",
        );
    };
    if let Some(origin) = headers.get(header::ORIGIN) {
        let own = origin
            .to_str()
            .is_ok_and(|o| o.strip_prefix("http://") == Some(host));
        if !own {
            return refuse(
                StatusCode::FORBIDDEN,
                "requests from web pages other than this API's own status page are refused",
            );
        }
    }
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !presented.is_some_and(|t| same_secret(t.trim().as_bytes(), api.secret.as_bytes())) {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "this request needs the token of `<data-dir>/api-token` as \
                 `Authorization: Bearer <token>`; `nodectl leave --data-dir <dir>` sends it",
            );
        }
    }
    next.run(request).await
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
        .layer(middleware::from_fn_with_state(Arc::clone(&api), guard))
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

/// A fresh secret for the control API: 32 random bytes from the operating system, in hex.
pub fn new_secret() -> Result<String> {
    use rand::TryRng;
    let mut bytes = [0u8; 32];
    rand::rngs::SysRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| anyhow::anyhow!("no randomness for the control API token: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Serves the API of the node that `node` reads until `leave` is cancelled (which
/// `POST /leave` does); `/metrics` encodes `metrics`; requests that change anything must
/// carry `secret`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    node: Readout,
    metrics: Registry,
    leave: CancellationToken,
    secret: String,
) -> Result<()> {
    let stop = leave.clone();
    let api = Arc::new(Api {
        node,
        metrics,
        leave,
        secret,
    });
    axum::serve(listener, router(api))
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
        .context("control API failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_are_loopback_hosts() {
        for host in [
            "127.0.0.1:7300",
            "[::1]:7300",
            "localhost:80",
            "LOCALHOST",
            "::1",
            "127.9.9.9",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example:7300",
            "10.0.0.1:7300",
            "[::2]:1",
            "localhost.evil.example",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn secrets_are_fresh_and_compared_whole() {
        let (a, b) = (new_secret().unwrap(), new_secret().unwrap());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(same_secret(a.as_bytes(), a.as_bytes()));
        assert!(!same_secret(a.as_bytes(), b.as_bytes()));
        assert!(!same_secret(a.as_bytes(), &a.as_bytes()[..63]));
    }
}
