//! Compressed payloads (bf16, int8 and int4 blocks, top-k): four bytes choose the codec, its
//! parameter and the number of values, the rest is the payload.
#![no_main]

use libfuzzer_sys::fuzz_target;
use murmur_protocol::codec::Codec;

fuzz_target!(|data: &[u8]| {
    let Some((&[kind, parameter, low, high], payload)) = data.split_first_chunk::<4>() else {
        return;
    };
    let values = usize::from(u16::from_le_bytes([low, high]));
    let parameter = u32::from(parameter);
    let codec = match kind % 5 {
        0 => Codec::F32,
        1 => Codec::Bf16,
        2 => Codec::Int8 { block: parameter },
        3 => Codec::Int4 { block: parameter },
        _ => Codec::TopK {
            per_mille: parameter * 4,
        },
    };
    if let Ok(decoded) = codec.decode(payload, values) {
        assert_eq!(decoded.len(), values);
        assert!(decoded.iter().all(|v| v.is_finite()));
    }
});
