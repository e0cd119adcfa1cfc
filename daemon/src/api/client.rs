//! The control-API client behind `nodectl status | peers | wait | leave`: it finds the daemon
//! of a data dir from `<data-dir>/api` and calls it with a short deadline.

use std::time::Duration;

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;

use crate::store::DataDir;

/// Longest a control-API call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

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

/// The token a request that changes anything carries: `<data-dir>/api-token`, which only
/// the daemon's user can read.
pub fn token(data: &DataDir) -> Result<String> {
    let path = data.api_token_path();
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read the control API token `{}`: run this as the user who started the \
             daemon, with its `--data-dir`",
            path.display()
        )
    })?;
    Ok(text.trim().to_owned())
}

/// The HTTP client of one call. It is reqwest's blocking client, which OTLP export already
/// builds in; the commands that call the API run no async runtime of their own.
fn client() -> Result<reqwest::blocking::Client> {
    reqwest::blocking::Client::builder()
        .timeout(CALL_TIMEOUT)
        .build()
        .context("could not set up an HTTP client for the control API")
}

/// `GET http://<addr><path>` as JSON.
pub fn get_json<T: DeserializeOwned>(addr: &str, path: &str) -> Result<T> {
    let body = client()?
        .get(format!("http://{addr}{path}"))
        .send()
        .and_then(reqwest::blocking::Response::error_for_status)
        .and_then(reqwest::blocking::Response::text)
        .with_context(|| {
            format!("the daemon at {addr} did not answer `GET {path}`; is it running?")
        })?;
    serde_json::from_str(&body)
        .with_context(|| format!("the daemon at {addr} sent an unreadable `{path}`"))
}

/// `POST http://<addr><path>` with an empty body, carrying `token`.
pub fn post(addr: &str, path: &str, token: &str) -> Result<()> {
    client()?
        .post(format!("http://{addr}{path}"))
        .bearer_auth(token)
        .send()
        .and_then(reqwest::blocking::Response::error_for_status)
        .with_context(|| format!("the daemon at {addr} did not answer `POST {path}`"))?;
    Ok(())
}
