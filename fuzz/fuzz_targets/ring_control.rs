//! The control messages a ring stream opens with (hello, accept, connect, refuse).
#![no_main]

use libfuzzer_sys::fuzz_target;
use murmur_protocol::fuzzing;

fuzz_target!(|data: &[u8]| {
    let _ = fuzzing::ring_control(data);
});
