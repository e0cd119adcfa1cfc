//! What the testbed tests share: the repository, whether this machine can run them, and
//! commands run under a deadline with the testbed's environment.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub(crate) fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Whether `test` can run here: as root, with `tools` installed. If not, it says why and
/// passes, unless MURMUR_REQUIRE_TOOLS is set (as CI does), when it fails.
pub(crate) fn can_run(test: &str, tools: &[&str]) -> bool {
    let root = std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|tool| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if root && missing.is_empty() {
        return true;
    }
    let why = if root {
        format!("{} not installed", missing.join(", "))
    } else {
        "it needs root".to_owned()
    };
    assert!(
        std::env::var_os("MURMUR_REQUIRE_TOOLS").is_none(),
        "the {test} test cannot run: {why}"
    );
    eprintln!("skipping the {test} test: {why}");
    false
}

/// `program`, killed after `deadline_s` seconds (coreutils `timeout`), with the namespaces
/// named after `prefix` and this build's wanlink.
pub(crate) fn command(deadline_s: &str, prefix: &str, program: impl AsRef<OsStr>) -> Command {
    let mut command = Command::new("timeout");
    command
        .arg(deadline_s)
        .arg(program)
        .env("NETNS_PREFIX", prefix)
        .env("WANLINK", env!("CARGO_BIN_EXE_wanlink"))
        .env("WANLINK_STATE", std::env::temp_dir());
    command
}

/// `output`, after failing the test with it if `what` failed.
pub(crate) fn succeeded(what: &str, output: Output) -> Output {
    assert!(
        output.status.success(),
        "{what} failed ({}; 124 is the deadline):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
