//! Unit tests of the CPU kernels.

use super::*;

#[test]
fn gemm_matches_naive_product_for_every_transpose() {
    let cpu = CpuBackend::new();
    let (m, n, k) = (3, 4, 5);
    let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i as f32).sin()).collect();
    let naive = |ta: bool, tb: bool| {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    c[i * n + j] += av * bv;
                }
            }
        }
        c
    };
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::new(m, n, k);
        g.transpose_a = ta;
        g.transpose_b = tb;
        let mut c = vec![0.0; m * n];
        cpu.gemm(g, &a, &b, &mut c).unwrap();
        for (x, y) in c.iter().zip(naive(ta, tb)) {
            assert!((x - y).abs() < 1e-4, "{ta} {tb}: {x} vs {y}");
        }
    }
}

#[test]
fn threaded_gemm_is_bitwise_equal_to_single_threaded() {
    let one = CpuBackend::new();
    let three = CpuBackend::with_threads(3).unwrap();
    for (m, n, k) in [(64, 256, 784), (300, 70, 33), (17, 513, 64), (5, 5, 5)] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 999.0 - 0.5)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104_729) % 997) as f32 / 996.0 - 0.5)
            .collect();
        for split in [GemmSplit::Auto, GemmSplit::Rows, GemmSplit::Columns] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let g = Gemm {
                    transpose_a: ta,
                    transpose_b: tb,
                    split,
                    ..Gemm::new(m, n, k)
                };
                let (mut c1, mut c3) = (vec![0.0; m * n], vec![0.0; m * n]);
                one.gemm(g, &a, &b, &mut c1).unwrap();
                three.gemm(g, &a, &b, &mut c3).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&c1), bits(&c3), "{m}x{n}x{k} {split:?} {ta} {tb}");
            }
        }
    }
}

#[test]
fn aligned_blocks_cover_the_range() {
    assert_eq!(aligned_blocks(256, 2, 16), [0..128, 128..256]);
    assert_eq!(aligned_blocks(100, 3, 16), [0..48, 48..96, 96..100]);
    assert_eq!(aligned_blocks(10, 2, 16).len(), 1);
    assert_eq!(aligned_blocks(0, 2, 16), Vec::<Range<usize>>::new());
}

#[test]
fn gemm_rejects_wrong_lengths() {
    let err = CpuBackend::new()
        .gemm(Gemm::new(2, 2, 2), &[0.0; 4], &[0.0; 3], &mut [0.0; 4])
        .unwrap_err();
    assert!(
        matches!(err, BackendError::Shape { operand: "b", .. }),
        "{err}"
    );
}

#[test]
fn swap_outer_axes_is_its_own_inverse() {
    let src: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let mut once = vec![0.0; 24];
    let mut twice = vec![0.0; 24];
    CpuBackend::new()
        .swap_outer_axes([2, 3, 4], &src, &mut once)
        .unwrap();
    CpuBackend::new()
        .swap_outer_axes([3, 2, 4], &once, &mut twice)
        .unwrap();
    assert_eq!(once[4..8], src[12..16]);
    assert_eq!(twice, src);
}

#[test]
fn im2col_and_col2im_are_adjoint() {
    // <im2col(x), p> == <x, col2im(p)> for any x and p.
    let g = ConvGeometry {
        channels: 2,
        height: 5,
        width: 4,
        kernel: 3,
        stride: 1,
        padding: 1,
    };
    let batch = 2;
    let x: Vec<f32> = (0..batch * g.image_len())
        .map(|i| (i as f32 * 0.37).cos())
        .collect();
    let plen = g.patch_len() * batch * g.out_pixels();
    let p: Vec<f32> = (0..plen).map(|i| (i as f32 * 0.11).sin()).collect();
    let mut cols = vec![0.0; plen];
    let mut back = vec![0.0; x.len()];
    CpuBackend::new().im2col(g, batch, &x, &mut cols).unwrap();
    CpuBackend::new().col2im(g, batch, &p, &mut back).unwrap();
    let lhs: f32 = cols.iter().zip(&p).map(|(a, b)| a * b).sum();
    let rhs: f32 = x.iter().zip(&back).map(|(a, b)| a * b).sum();
    assert!((lhs - rhs).abs() < 1e-3, "{lhs} vs {rhs}");
}

#[test]
fn softmax_cross_entropy_of_uniform_logits_is_log_classes() {
    let mut d = vec![0.0; 8];
    let loss = CpuBackend::new()
        .softmax_cross_entropy(4, &[0.0; 8], &[1, 3], &mut d)
        .unwrap();
    assert!((loss - 4f32.ln()).abs() < 1e-6);
    assert!((d[1] - (0.25 - 1.0) / 2.0).abs() < 1e-7);
    assert!((d.iter().sum::<f32>()).abs() < 1e-6);
}

#[test]
fn softmax_cross_entropy_rejects_bad_label() {
    let mut d = vec![0.0; 4];
    let err = CpuBackend::new()
        .softmax_cross_entropy(4, &[0.0; 4], &[7], &mut d)
        .unwrap_err();
    assert!(matches!(err, BackendError::Label { label: 7, .. }));
}

#[test]
fn sgd_matches_hand_computed_steps() {
    // PyTorch SGD(lr=0.1, momentum=0.9, weight_decay=0.01), two steps with grad 1.0:
    // d1 = 1 + 0.01*1 = 1.01, v1 = 1.01, p1 = 1 - 0.101 = 0.899
    // d2 = 1 + 0.00899 = 1.00899, v2 = 0.909 + 1.00899 = 1.91799, p2 = 0.899 - 0.191799
    let u = SgdUpdate {
        lr: 0.1,
        momentum: 0.9,
        nesterov: false,
        weight_decay: 0.01,
    };
    let (mut p, mut v) = (vec![1.0f32], vec![0.0f32]);
    CpuBackend::new()
        .sgd_update(u, &mut p, &[1.0], &mut v)
        .unwrap();
    assert!((p[0] - 0.899).abs() < 1e-6);
    CpuBackend::new()
        .sgd_update(u, &mut p, &[1.0], &mut v)
        .unwrap();
    assert!((p[0] - (0.899 - 0.191_799)).abs() < 1e-6, "{}", p[0]);

    // Nesterov: step = d + mu * v; first step d = 1, v = 1, step = 1.9.
    let n = SgdUpdate {
        nesterov: true,
        weight_decay: 0.0,
        ..u
    };
    let (mut p, mut v) = (vec![1.0f32], vec![0.0f32]);
    CpuBackend::new()
        .sgd_update(n, &mut p, &[1.0], &mut v)
        .unwrap();
    assert!((p[0] - 0.81).abs() < 1e-6);
}

#[test]
fn adamw_first_step_moves_by_lr() {
    // With bias correction the first Adam step is lr * g / (|g| + eps') = lr * sign(g),
    // after decoupled decay p * (1 - lr * wd).
    let u = AdamWUpdate {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    let (mut p, mut m, mut v) = (vec![2.0f32, 2.0], vec![0.0; 2], vec![0.0; 2]);
    CpuBackend::new()
        .adamw_update(u, &mut p, &[0.5, -3.0], &mut m, &mut v)
        .unwrap();
    let decayed = 2.0 * (1.0 - 0.01 * 0.1);
    assert!((p[0] - (decayed - 0.01)).abs() < 1e-6, "{}", p[0]);
    assert!((p[1] - (decayed + 0.01)).abs() < 1e-6, "{}", p[1]);
}

#[test]
fn max_pool_routes_gradient_to_the_maximum() {
    let g = PoolGeometry {
        height: 2,
        width: 4,
        window: 2,
    };
    let x = [1.0, 5.0, 0.0, 0.0, 2.0, 3.0, 0.0, 7.0];
    let mut y = [0.0; 2];
    CpuBackend::new().max_pool(g, 1, &x, &mut y).unwrap();
    assert_eq!(y, [5.0, 7.0]);
    let mut dx = [9.0; 8];
    CpuBackend::new()
        .max_pool_backward(g, 1, &x, &y, &[1.0, 2.0], &mut dx)
        .unwrap();
    assert_eq!(dx, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]);
}
