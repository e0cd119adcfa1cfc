//! Node configs (`<data-dir>/config.toml`).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use murmur_daemon::config::NodeConfig;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = NodeConfig::parse(Path::new("config.toml"), text);
    }
});
