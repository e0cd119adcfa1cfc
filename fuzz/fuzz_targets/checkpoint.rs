//! Checkpoints (safetensors with Murmur's metadata) for a tiny MLP, as resume and
//! `nodectl evaluate` read them.
#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use murmur_trainer::ModelSpec;
use murmur_trainer::checkpoint::Checkpoint;
use murmur_trainer::params::ParamLayout;

static LAYOUT: LazyLock<ParamLayout> = LazyLock::new(|| {
    let spec = ModelSpec {
        hidden: Some(vec![1]),
        ..ModelSpec::mlp()
    };
    spec.build().expect("a tiny MLP builds").layout().clone()
});

fuzz_target!(|data: &[u8]| {
    if let Ok(checkpoint) = Checkpoint::from_bytes(Path::new("fuzz.safetensors"), data, &LAYOUT) {
        assert_eq!(checkpoint.params.len(), LAYOUT.len());
        for state in &checkpoint.optimizer_state {
            assert_eq!(state.len(), LAYOUT.len());
        }
    }
});
