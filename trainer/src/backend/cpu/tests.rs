//! Tests of what only the CPU backend has: its threads. The kernels' own tests run on every
//! device (`backend/tests.rs`).

use proptest::prelude::*;

use super::*;

#[test]
fn threaded_gemm_is_bitwise_equal_to_single_threaded() {
    let one = CpuBackend::new();
    let three = CpuBackend::with_threads(3).unwrap();
    // Shapes where `gemm` would sum a block in another order: a block of at most 64 x 64 with
    // k above 512 (another depth blocking), a last block one column wide (a matrix-vector
    // product), blocks of at most 256 values (dot products).
    for (m, n, k) in [
        (64, 256, 784),
        (300, 70, 33),
        (17, 513, 64),
        (5, 5, 5),
        (64, 97, 1500),
        (16, 40, 2000),
        (189, 10, 1247),
        (12, 82, 533),
    ] {
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any shape, transposes and scales: three threads give the bits of one.
    #[test]
    fn any_threaded_gemm_is_bitwise_equal_to_single_threaded(
        m in 1usize..200,
        n in 1usize..200,
        k in 1usize..1200,
        transpose_a: bool,
        transpose_b: bool,
        alpha in prop_oneof![Just(1.0f32), Just(-0.5)],
        beta in prop_oneof![Just(0.0f32), Just(1.0), Just(0.25)],
        split in prop_oneof![Just(GemmSplit::Auto), Just(GemmSplit::Rows), Just(GemmSplit::Columns)],
    ) {
        let g = Gemm { transpose_a, transpose_b, alpha, beta, split, ..Gemm::new(m, n, k) };
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 999.0 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 997) as f32 / 996.0 - 0.5).collect();
        let c: Vec<f32> = (0..m * n).map(|i| ((i * 31) % 101) as f32 / 100.0 - 0.5).collect();
        let (mut c1, mut c3) = (c.clone(), c);
        CpuBackend::new().gemm(g, &a, &b, &mut c1).unwrap();
        CpuBackend::with_threads(3).unwrap().gemm(g, &a, &b, &mut c3).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&c1), bits(&c3));
    }
}

#[test]
fn aligned_blocks_cover_the_range() {
    assert_eq!(aligned_blocks(256, 2, 16), [0..128, 128..256]);
    assert_eq!(aligned_blocks(100, 3, 16), [0..48, 48..96, 96..100]);
    assert_eq!(aligned_blocks(10, 2, 16).len(), 1);
    assert_eq!(aligned_blocks(0, 2, 16), Vec::<Range<usize>>::new());
}

/// The row and elementwise kernels that share their work between threads, on inputs long
/// enough to be split: three threads give the bits of one.
#[test]
fn split_kernels_are_bitwise_equal_to_single_threaded() {
    let one = CpuBackend::new();
    let three = CpuBackend::with_threads(3).unwrap();
    let values = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919) % 1000) as f32 / 99.0 - 5.0)
            .collect()
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (rows, channels) = (301, 203);
    let dy = values(rows * channels, 1);
    let layout = ChannelLayout {
        outer: rows,
        channels,
        inner: 1,
    };
    let (mut db1, mut db3) = (vec![0.0; channels], vec![0.0; channels]);
    one.bias_grad(layout, &dy, &mut db1).unwrap();
    three.bias_grad(layout, &dy, &mut db3).unwrap();
    assert_eq!(bits(&db1), bits(&db3), "bias_grad");

    let (rows, classes) = (513, 97);
    let logits = values(rows * classes, 2);
    let labels: Vec<u32> = (0..rows).map(|i| (i * 31 % classes) as u32).collect();
    let (mut d1, mut d3) = (vec![0.0; rows * classes], vec![0.0; rows * classes]);
    let loss1 = one
        .softmax_cross_entropy(classes, &logits, &labels, &mut d1)
        .unwrap();
    let loss3 = three
        .softmax_cross_entropy(classes, &logits, &labels, &mut d3)
        .unwrap();
    assert_eq!(
        loss1.to_bits(),
        loss3.to_bits(),
        "softmax_cross_entropy loss"
    );
    assert_eq!(bits(&d1), bits(&d3), "softmax_cross_entropy gradient");

    let dims = [9, 16, 5, 64];
    let src = values(dims.iter().product(), 3);
    let (mut s1, mut s3) = (vec![0.0; src.len()], vec![0.0; src.len()]);
    one.swap_middle_axes(dims, &src, &mut s1).unwrap();
    three.swap_middle_axes(dims, &src, &mut s3).unwrap();
    assert_eq!(bits(&s1), bits(&s3), "swap_middle_axes");

    let x = values(70_001, 4);
    let (mut y1, mut y3) = (values(x.len(), 5), values(x.len(), 5));
    one.axpy(0.3, &x, &mut y1).unwrap();
    three.axpy(0.3, &x, &mut y3).unwrap();
    assert_eq!(bits(&y1), bits(&y3), "axpy");
    three.copy(&x, &mut y3).unwrap();
    assert_eq!(bits(&x), bits(&y3), "copy");
}
