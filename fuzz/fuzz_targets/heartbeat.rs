//! Heartbeats as they arrive on the run's gossipsub topic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use murmur_protocol::heartbeat::Heartbeat;

fuzz_target!(|data: &[u8]| {
    if let Ok(heartbeat) = Heartbeat::decode(data, "fuzz", "fp") {
        // What was accepted survives a round trip unchanged.
        let again = Heartbeat::decode(&heartbeat.encode(), "fuzz", "fp");
        assert_eq!(again.ok(), Some(heartbeat));
    }
});
