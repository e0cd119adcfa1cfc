//! IDX dataset files, gzipped or not: the first byte gives the dimensions expected (images 3,
//! labels 1), the rest is the file.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use murmur_trainer::data::idx;

fuzz_target!(|data: &[u8]| {
    let Some((&ndim, file)) = data.split_first() else {
        return;
    };
    let ndim = 1 + ndim % 4;
    if let Ok(array) = idx::decode(Path::new("fuzz.idx"), file.to_vec(), ndim) {
        assert_eq!(array.dims.len(), usize::from(ndim));
        assert_eq!(array.dims.iter().product::<usize>(), array.data.len());
    }
});
