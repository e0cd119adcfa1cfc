//! The hostile-peer suite: each test plays one behaviour of a stranger or a local attacker
//! against real daemons (processes, or whole nodes in this process over the memory transport)
//! and checks that the honest side is not stopped, poisoned or taken over. The adversaries are
//! hand-driven here, not part of `nodectl`. Every wait has a deadline.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::{Daemon, endless_mlp_run, status};

/// Sends `request` (an HTTP/1.1 request without its final blank line) to the control API of
/// the daemon of `dir` and returns the status code of the answer.
fn http(dir: &Path, request: &str) -> u16 {
    let addr = std::fs::read_to_string(dir.join("api")).unwrap();
    let mut stream = TcpStream::connect(addr.trim()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "{request}Connection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let code = answer.split(' ').nth(1).unwrap_or_default();
    code.parse()
        .unwrap_or_else(|_| panic!("no status line in {answer:?}"))
}

/// A web page or another local user cannot make a node leave: `POST /leave` needs the token
/// of the owner-only `api-token` file, and the API refuses requests for a host other than
/// loopback (DNS rebinding) and from other origins, even with the token. Reads stay open to
/// the status page and scrapers. Before the fix a bare `POST /leave` made the node leave.
#[test]
fn the_control_api_refuses_to_leave_without_the_token_or_from_a_web_page() {
    let work = endless_mlp_run("solo", "");
    let dir = work.path().join("a");
    let daemon = Daemon::start(work.path(), "a", &[]);
    let addr = std::fs::read_to_string(dir.join("api")).unwrap();
    let host = addr.trim();
    let token_file = dir.join("api-token");
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the token is the owner's alone");
    let token = std::fs::read_to_string(&token_file).unwrap();
    let token = token.trim();

    let leave = |headers: &str| http(&dir, &format!("POST /leave HTTP/1.1\r\n{headers}"));
    assert_eq!(leave(&format!("Host: {host}\r\n")), 401, "no token");
    assert_eq!(
        leave(&format!(
            "Host: {host}\r\nAuthorization: Bearer {}\r\n",
            "0".repeat(token.len())
        )),
        401,
        "a wrong token"
    );
    let with_token = format!("Authorization: Bearer {token}\r\n");
    assert_eq!(
        leave(&format!(
            "Host: {host}\r\nOrigin: http://evil.example\r\n{with_token}"
        )),
        403,
        "another origin"
    );
    assert_eq!(
        leave(&format!("Host: evil.example:80\r\n{with_token}")),
        403,
        "a name that points here"
    );
    assert_eq!(
        http(&dir, "GET /status HTTP/1.1\r\nHost: evil.example\r\n"),
        403,
        "reads under a foreign name"
    );
    assert_eq!(
        http(&dir, &format!("GET /status HTTP/1.1\r\nHost: {host}\r\n")),
        200
    );
    // The status page's own requests carry its origin.
    let own = format!("Host: {host}\r\nOrigin: http://{host}\r\n");
    assert_eq!(http(&dir, &format!("GET /history HTTP/1.1\r\n{own}")), 200);
    assert_eq!(
        status(&dir)["state"],
        "training",
        "still running after the refusals"
    );

    // `nodectl leave` reads the token: the node leaves, and both files go with it.
    daemon.leave(&dir);
    assert!(!dir.join("api").exists() && !token_file.exists());
}
