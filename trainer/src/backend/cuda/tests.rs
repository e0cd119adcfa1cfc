//! What the CUDA backend can show without a GPU: probing and compiling its kernels.

use super::*;

#[test]
fn probing_a_machine_without_cuda_gives_a_reason_instead_of_a_panic() {
    // On a GPU machine this passes too: cuda:4096 does not exist anywhere.
    let reason = probe(4096).expect_err("no machine has 4097 GPUs");
    assert!(!reason.0.is_empty());
    let err = CudaBackend::new(4096).expect_err("no such device");
    assert!(
        matches!(err, BackendError::Device { op: "open", .. }),
        "{err}"
    );
}

#[test]
fn kernels_compile_with_nvrtc() {
    if !nvrtc_present() {
        eprintln!("NVRTC (libnvrtc.so.{CUDA_MAJOR}) is not installed here: not compiled");
        return;
    }
    let ptx = compile_kernels().expect("kernels.cu compiles");
    let text = ptx.to_src();
    for kernel in [
        "fill",
        "im2col",
        "col2im",
        "softmax_cross_entropy",
        "adamw_update",
        "gelu",
        "gelu_backward",
        "layer_norm",
        "layer_norm_backward",
        "layer_norm_param_grads",
        "causal_softmax",
        "causal_softmax_backward",
        "swap_middle_axes",
        "embed",
        "embed_backward",
        "scale",
        "square_sums",
    ] {
        assert!(
            text.contains(&format!(".entry {kernel}(")),
            "{kernel} missing from the PTX"
        );
    }
}
