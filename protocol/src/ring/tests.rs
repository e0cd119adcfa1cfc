//! The ring's schedule, frames and rounds, over in-memory pipes.

use futures::io::AsyncWriteExt;
use libp2p_identity::PeerId;

use super::frame::checksum;
use super::*;
use crate::trust::TrustList;
use proptest::prelude::*;
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

type Pipe = Compat<tokio::io::DuplexStream>;

/// `size` ring links: link `i` runs from member `i` to member `i + 1`.
fn ring_links(size: usize) -> Vec<RingLinks<Pipe, Pipe>> {
    let (mut writers, mut readers) = (Vec::new(), Vec::new());
    for _ in 0..size {
        let (a, b) = tokio::io::duplex(64 * 1024);
        writers.push(Some(a.compat()));
        readers.push(Some(b.compat()));
    }
    (0..size)
        .map(|rank| {
            RingLinks::new(
                readers[(rank + size - 1) % size].take().expect("once"),
                writers[rank].take().expect("once"),
            )
        })
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("runtime")
}

/// Runs rounds over in-memory pipes; returns every member's buffers after each round.
fn run_ring(buffers: Vec<Vec<f32>>, sub_chunk: usize, rounds: u64) -> Vec<Vec<f32>> {
    let size = buffers.len();
    runtime().block_on(async move {
        let tasks: Vec<_> = ring_links(size)
            .into_iter()
            .zip(buffers)
            .enumerate()
            .map(|(rank, (mut links, mut buffer))| {
                tokio::spawn(async move {
                    let schedule = RingSchedule::new(rank, size, buffer.len(), sub_chunk);
                    for round in 0..rounds {
                        let (traffic, kept) = all_reduce(schedule, round, 7, &mut buffer, links)
                            .await
                            .expect("round");
                        assert_eq!(traffic.payload_sent, schedule.payload_bytes_sent());
                        links = kept;
                    }
                    buffer
                })
            })
            .collect();
        let mut out = Vec::new();
        for task in tasks {
            out.push(task.await.expect("member"));
        }
        out
    })
}

#[test]
fn chunks_cover_the_buffer_and_differ_by_at_most_one() {
    for (len, size) in [(10, 3), (2, 4), (0, 2), (1_000_003, 4)] {
        let s = RingSchedule::new(0, size, len, 7);
        let sizes: Vec<usize> = (0..size).map(|k| s.chunk(k).len()).collect();
        assert_eq!(s.chunk(0).start, 0);
        assert_eq!(s.chunk(size - 1).end, len);
        for k in 1..size {
            assert_eq!(s.chunk(k - 1).end, s.chunk(k).start);
        }
        let (min, max) = (sizes.iter().min(), sizes.iter().max());
        assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{sizes:?}");
    }
}

#[test]
fn each_member_sends_two_p_minus_one_over_p_of_the_buffer() {
    for size in 2..=4 {
        let len = 1200;
        let s = RingSchedule::new(1, size, len, 64);
        let expected = 2 * (size - 1) * len * 4 / size;
        assert_eq!(s.payload_bytes_sent(), expected as u64);
    }
}

#[test]
fn the_receiver_gets_what_its_left_neighbour_sends() {
    for size in 2..=5 {
        for rank in 0..size {
            let me = RingSchedule::new(rank, size, 100, 10);
            let left = RingSchedule::new((rank + size - 1) % size, size, 100, 10);
            for phase in [Phase::ReduceScatter, Phase::AllGather] {
                for step in 0..me.steps() {
                    assert_eq!(me.recv_chunk(phase, step), left.send_chunk(phase, step));
                }
            }
            // After the reduce-scatter this member owns chunk rank + 1, which it sends first
            // in the all-gather.
            assert_eq!(
                me.recv_chunk(Phase::ReduceScatter, me.steps() - 1),
                me.send_chunk(Phase::AllGather, 0)
            );
        }
    }
}

#[test]
fn a_ring_holds_only_trusted_live_members() {
    let [me, a, b, stranger] = [(); 4].map(|()| PeerId::random());
    let trust = TrustList::new([a, b]);
    let ring = trust.ring("r", me, [a, stranger]);
    let mut expected = vec![me, a];
    expected.sort_by_key(|p| p.to_bytes());
    assert_eq!(ring.peers(), expected.as_slice());
    assert!(ring.rank_of(&stranger).is_none());
}

#[test]
fn membership_hash_ignores_order_and_names_the_run() {
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let a = RingMembers::new("r", peers.clone());
    let reversed = RingMembers::new("r", peers.iter().rev().copied().collect());
    assert_eq!(a, reversed);
    assert_ne!(a.hash(), RingMembers::new("other", peers.clone()).hash());
    assert_ne!(a.hash(), RingMembers::new("r", peers[..2].to_vec()).hash());
    let rank = a.rank_of(&peers[1]).expect("member");
    assert_eq!(
        a.left_of(a.rank_of(&a.right_of(rank)).expect("member")),
        peers[1]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Every member ends with the same values, bit for bit, and they are the exact sum; the
    /// reducers driven without I/O end with the same bits.
    #[test]
    fn all_reduce_sums_for_any_length(
        size in 2usize..=4,
        len in 0usize..3000,
        sub_chunk in 1usize..400,
        seed in any::<u64>(),
    ) {
        let buffers: Vec<Vec<f32>> = (0..size)
            .map(|rank| {
                (0..len)
                    .map(|i| {
                        let x = (seed ^ (rank as u64 * 7919 + i as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                    })
                    .collect()
            })
            .collect();
        let exact: Vec<f64> = (0..len)
            .map(|i| buffers.iter().map(|b| f64::from(b[i])).sum())
            .collect();
        // The reducers driven by hand, as the simulator drives them, give the same bits.
        let (by_hand, _, _) = super::reducer::tests::reduce_by_hand(buffers.clone(), sub_chunk);
        let out = run_ring(buffers, sub_chunk, 1);
        prop_assert_eq!(
            bytemuck::cast_slice::<f32, u32>(&by_hand[0]),
            bytemuck::cast_slice::<f32, u32>(&out[0])
        );
        for member in &out {
            prop_assert_eq!(
                bytemuck::cast_slice::<f32, u32>(member),
                bytemuck::cast_slice::<f32, u32>(&out[0])
            );
        }
        for (got, want) in out[0].iter().zip(&exact) {
            prop_assert!((f64::from(*got) - want).abs() <= 1e-6 * (1.0 + want.abs()), "{got} vs {want}");
        }
    }
}

#[test]
fn links_carry_several_rounds() {
    let buffers = vec![vec![1.0f32; 1001], vec![2.0; 1001], vec![3.0; 1001]];
    // Each round sums the previous sums: 6, then 18, then 54.
    let out = run_ring(buffers, 100, 3);
    assert!(out.iter().all(|b| b.iter().all(|&v| v == 54.0)));
}

/// A left neighbour that sends `frame` after a correct round header; returns what the
/// receiving member (rank 1 of 2) reports, and its buffer.
fn receive_from_forger(forge: impl FnOnce(&mut Vec<u8>)) -> (RingError, Vec<f32>) {
    runtime().block_on(async move {
        let schedule = RingSchedule::new(1, 2, 8, 4);
        let (left_end, from_left) = tokio::io::duplex(1 << 16);
        let (to_right, right_end) = tokio::io::duplex(1 << 16);
        let header = RoundHeader {
            round: 3,
            membership: 9,
            sender: 0,
            len: 8,
            sub_chunk: 4,
        };
        let mut bytes = header.encode().to_vec();
        forge(&mut bytes);
        let mut left_end = left_end.compat();
        left_end.write_all(&bytes).await.expect("write");
        // Keep the other ends open: the receiver must fail on what it read, not on a close.
        let _keep = (left_end, right_end);
        let mut buffer = vec![1.0f32; 8];
        let links = RingLinks::new(from_left.compat(), to_right.compat());
        let error = all_reduce(schedule, 3, 9, &mut buffer, links)
            .await
            .expect_err("the round must fail");
        (error, buffer)
    })
}

fn sub_chunk(seq: u32, values: &[f32], checksum_delta: u32) -> Vec<u8> {
    let data: &[u8] = bytemuck::cast_slice(values);
    let mut out = Vec::new();
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&(checksum(values) ^ checksum_delta).to_le_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn a_sub_chunk_header_is_its_three_fields_little_endian() {
    let values = [1.0f32, -2.5];
    let header = SubChunkHeader {
        seq: 7,
        bytes: 8,
        checksum: checksum(&values),
    };
    let wire = sub_chunk(7, &values, 0);
    assert_eq!(header.encode(), wire[..SUB_CHUNK_HEADER_BYTES]);
    let read: &[u8; SUB_CHUNK_HEADER_BYTES] = wire[..SUB_CHUNK_HEADER_BYTES].try_into().unwrap();
    assert_eq!(SubChunkHeader::decode(read), header);
}

#[test]
fn a_wrong_size_checksum_or_header_aborts_the_round() {
    let (error, _) = receive_from_forger(|b| b.extend(sub_chunk(0, &[1.0; 5], 0)));
    assert!(
        matches!(
            error,
            RingError::WrongSize {
                expected: 16,
                found: 20,
                ..
            }
        ),
        "{error}"
    );
    let (error, _) = receive_from_forger(|b| b.extend(sub_chunk(0, &[1.0; 4], 1)));
    assert!(
        matches!(error, RingError::Checksum { seq: 0, .. }),
        "{error}"
    );
    let (error, _) = receive_from_forger(|b| b.extend(sub_chunk(1, &[1.0; 4], 0)));
    assert!(
        matches!(
            error,
            RingError::OutOfOrder {
                expected: 0,
                found: 1
            }
        ),
        "{error}"
    );
    // Another membership hash.
    let (error, _) = receive_from_forger(|b| b[16] ^= 1);
    assert!(matches!(error, RingError::Mismatch { .. }), "{error}");
    assert!(error.is_offence());
    // Another round.
    let (error, _) = receive_from_forger(|b| b[8] ^= 1);
    assert!(matches!(error, RingError::Mismatch { .. }), "{error}");
    let (error, _) = receive_from_forger(|b| b[0] = b'X');
    assert!(matches!(error, RingError::Malformed(_)), "{error}");
}

#[test]
fn a_vanished_neighbour_is_not_an_offence() {
    let error = runtime().block_on(async {
        let schedule = RingSchedule::new(0, 2, 8, 4);
        let (left_end, from_left) = tokio::io::duplex(1 << 16);
        let (to_right, _right_end) = tokio::io::duplex(1 << 16);
        drop(left_end);
        let links = RingLinks::new(from_left.compat(), to_right.compat());
        all_reduce(schedule, 0, 1, &mut [0.0; 8], links).await.err()
    });
    let error = error.expect("the round must fail");
    assert!(matches!(error, RingError::Closed), "{error}");
    assert!(!error.is_offence());
}
