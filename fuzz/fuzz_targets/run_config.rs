//! Run configs (`configs/*.toml`): parsed and validated as `nodectl join -c` does.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use murmur_daemon::config::RunConfig;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = RunConfig::parse(Path::new("fuzz.toml"), text);
    }
});
