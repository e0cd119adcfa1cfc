//! Tests of what only the CPU backend has: its threads. The kernels' own tests run on every
//! device (`backend/tests.rs`).

use super::*;

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
