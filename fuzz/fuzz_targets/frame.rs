//! Tensor frames as a peer sends them on `/murmur/params` and `/murmur/state`: a stream of
//! frames, read with one reused buffer as the engine reads them.
#![no_main]

use futures::executor::block_on;
use libfuzzer_sys::fuzz_target;
use murmur_protocol::wire::{self, Codec, Expect};

const EXPECT: Expect<'static> = Expect {
    run_id: "fuzz",
    fingerprint: "fp",
    max_payload_bytes: 1 << 16,
};

fuzz_target!(|data: &[u8]| {
    let mut stream = data;
    let mut buffer = Vec::new();
    while let Ok(header) = block_on(wire::read_frame(&mut stream, &EXPECT, &mut buffer)) {
        assert_eq!(buffer.len() as u64, header.values());
        if header.codec != Codec::F32 {
            assert!(buffer.iter().all(|v| v.is_finite()));
        }
    }
});
