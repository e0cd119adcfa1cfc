//! What an exchange costs a PyTorch model, on the node's own path: a hand-over (the model's
//! tensors into a lent buffer, `Replica::params`), the mix's delta (computed in place from the
//! partner's parameters, as the replica's rules do) and its landing (added to the tensors,
//! `Replica::add`), each timed against a memcpy of the same bytes.
//! `bench/pytorch_exchange.py` prints the figures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use murmur_daemon::node::replica::{Replica, ReplicaInfo};
use murmur_protocol::mix;
use pyo3::prelude::*;

use crate::checkpoints::Checkpoints;
use crate::replica::{SharedClock, TorchReplica};
use crate::swarm::description;

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64()
}

/// Times `rounds` hand-overs and mixes of the model `replica` describes, and as many copies
/// of its bytes; a JSON object of medians, in seconds.
pub(crate) fn exchange(py: Python<'_>, adapter: Py<PyAny>, rounds: usize) -> PyResult<String> {
    let model = description(py, &adapter)?;
    let count = model.param_count();
    let info = ReplicaInfo {
        model: model.clone(),
        kind: "pytorch".into(),
        device: adapter.bind(py).call_method0("device")?.extract()?,
        optimizer_buffers: Vec::new(),
        steps_per_epoch: None,
    };
    let checkpoints = Checkpoints {
        dir: std::env::temp_dir(),
        model,
        run: "bench".into(),
        keep: 1,
    };
    let mut replica =
        TorchReplica::new(adapter, info, Arc::new(SharedClock::default()), checkpoints);
    let failed = |e: anyhow::Error| crate::MurmurError::new_err(format!("{e:#}"));
    let (mut hand_overs, mut deltas, mut adds, mut copies) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The partner's parameters as the engine hands them over, and the snapshot they mix with.
    let mut other = vec![0.25f32; count];
    let base = vec![0.5f32; count];
    let mut copy = vec![0.0f32; count];
    // One round unmeasured: the buffers' pages come in.
    for round in 0..=rounds {
        let started = Instant::now();
        let snapshot = replica.params().map_err(failed)?;
        let handed = started.elapsed();

        // The mix of a round: the delta is the partner's buffer (zero, so that the model does
        // not drift over the rounds), the snapshot becomes the next partner buffer.
        other.fill(0.5);
        let started = Instant::now();
        mix::into_delta(&mut other, &base, 0.5);
        let delta = started.elapsed();
        let started = Instant::now();
        replica.add(other, Some(8)).map_err(failed)?;
        let added = started.elapsed();
        other = snapshot;

        let started = Instant::now();
        copy.copy_from_slice(&base);
        let copied = started.elapsed();
        if round > 0 {
            hand_overs.push(handed);
            deltas.push(delta);
            adds.push(added);
            copies.push(copied);
        }
        py.check_signals()?;
    }
    let memcpy = median(copies);
    let (hand_over, delta, add) = (median(hand_overs), median(deltas), median(adds));
    Ok(serde_json::json!({
        "params": count,
        "bytes": count * 4,
        "rounds": rounds,
        "memcpy_s": memcpy,
        "hand_over_s": hand_over,
        "delta_s": delta,
        "apply_s": add,
        "hand_over_per_memcpy": hand_over / memcpy,
        "delta_per_memcpy": delta / memcpy,
        "apply_per_memcpy": add / memcpy,
        "hand_over_and_apply_per_memcpy": (hand_over + add) / memcpy,
    })
    .to_string())
}
