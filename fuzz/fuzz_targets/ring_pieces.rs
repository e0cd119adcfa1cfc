//! Ring sub-chunks (sequence number, length, checksum, values): two bytes give the values due
//! per sub-chunk, the rest is the stream from the left neighbour.
#![no_main]

use libfuzzer_sys::fuzz_target;
use murmur_protocol::fuzzing;

fuzz_target!(|data: &[u8]| {
    let Some((&[low, high], stream)) = data.split_first_chunk::<2>() else {
        return;
    };
    let values = usize::from(u16::from_le_bytes([low, high]) % 4096);
    let _ = fuzzing::ring_pieces(stream, values);
});
