//! The round header that opens every ring data connection.
#![no_main]

use libfuzzer_sys::fuzz_target;
use murmur_protocol::fuzzing;

fuzz_target!(|data: &[u8]| {
    let _ = fuzzing::ring_round_header(data);
});
