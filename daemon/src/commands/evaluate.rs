//! `nodectl evaluate`: test accuracy of checkpoints, their consensus distance, and (for node
//! data dirs) what each daemon did during the run.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use murmur_trainer::averaging;
use murmur_trainer::checkpoint;
use murmur_trainer::data::{Dataset, Split};
use murmur_trainer::{Backend, Trainer};
use serde::Serialize;

use crate::api::types::{AccuracyPoint, StatusReport};
use crate::cli::EvaluateArgs;
use crate::config::RunConfig;
use crate::device::{on_backend, select_backend};
use crate::store::DataDir;

#[derive(Debug, Serialize)]
struct Evaluated {
    path: PathBuf,
    step: u64,
    test_accuracy: f64,
    test_loss: f64,
    /// From the node's `last-status.json`, when PATH is a node data dir.
    node: Option<NodeSummary>,
}

/// What a daemon reported when it exited.
#[derive(Debug, Serialize)]
struct NodeSummary {
    peer_id: String,
    steps: u64,
    samples_seen: u64,
    bytes_out: u64,
    bytes_in: u64,
    bytes_out_per_step: f64,
    exchanges: u64,
    served: u64,
    busy: u64,
    stale: u64,
    rejected: u64,
    failed: u64,
    state_syncs: u64,
    gate_wait_s: f64,
    /// The longest single wait at the staleness gate.
    longest_gate_wait_s: f64,
    exchange_wait_s: f64,
    longest_stall_s: f64,
    max_lead: u64,
    /// Peers this node gave up on for silence (in a run without kills, a live peer's).
    peers_timed_out: u64,
    started_unix_s: f64,
    /// Seconds from the first node's start until this node's own test accuracy first reached
    /// the target (`--target`): in a mixed swarm, how late each peer got there.
    reached_target_s: Option<f64>,
}

#[derive(Debug, Serialize)]
struct EvaluateReport {
    checkpoints: Vec<Evaluated>,
    mean_test_accuracy: f64,
    /// `max_i ||x_i - mean|| / ||mean||` over the checkpoints (with two or more).
    consensus_distance: Option<f64>,
    /// Test accuracy of the mean of the checkpoints' parameters (with two or more): what one
    /// final all-reduce would give.
    mean_model_test_accuracy: Option<f64>,
    /// The elastic center found in a node's checkpoint directory.
    center: Option<Evaluated>,
    target: Option<f64>,
    /// Seconds from the first node's start until the mean of the nodes' latest test
    /// accuracies first reached `target`.
    time_to_target_s: Option<f64>,
}

/// The checkpoint file a PATH names.
fn resolve(path: &Path) -> Result<PathBuf> {
    if path.is_file() {
        return Ok(path.to_owned());
    }
    if !path.is_dir() {
        bail!(
            "`{}` does not exist: pass a checkpoint file or directory",
            path.display()
        );
    }
    for dir in [path.join("checkpoints"), path.to_owned()] {
        if let Some(found) = checkpoint::latest(&dir)? {
            return Ok(found);
        }
    }
    bail!(
        "no `step-N.safetensors` checkpoint in `{}` or its `checkpoints/`",
        path.display()
    )
}

fn last_status(path: &Path) -> Result<Option<StatusReport>> {
    let file = DataDir::new(path.to_owned()).last_status_path();
    if !file.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&file)?;
    let status = serde_json::from_str(&text)
        .with_context(|| format!("`{}` is not a status written by nodectl", file.display()))?;
    Ok(Some(status))
}

/// `s` summarized; `start` is the first node's start and `target` the accuracy to time.
fn summarize(s: &StatusReport, start: f64, target: Option<f64>) -> NodeSummary {
    let reached_target_s = target.and_then(|target| first_reached(&s.history, start, target));
    NodeSummary {
        peer_id: s.peer_id.clone(),
        steps: s.step,
        samples_seen: s.samples_seen,
        bytes_out: s.sync.bytes_out,
        bytes_in: s.tensor_bytes_in,
        bytes_out_per_step: s.sync.bytes_out as f64 / s.step.max(1) as f64,
        exchanges: s.sync.exchanges,
        served: s.sync.served,
        busy: s.sync.busy,
        stale: s.sync.stale,
        rejected: s.sync.rejected,
        failed: s.sync.failed,
        state_syncs: s.sync.state_syncs,
        gate_wait_s: s.sync.gate_wait_s,
        longest_gate_wait_s: s.sync.longest_gate_wait_s,
        exchange_wait_s: s.sync.exchange_wait_s,
        longest_stall_s: s.sync.longest_stall_s,
        max_lead: s.sync.max_lead,
        peers_timed_out: s.peers_timed_out,
        started_unix_s: s.started_unix_s,
        reached_target_s,
    }
}

/// When `history` first reached `target`, in seconds after `start`.
fn first_reached(history: &[AccuracyPoint], start: f64, target: f64) -> Option<f64> {
    let reached = history.iter().find(|h| h.test_accuracy >= target)?;
    Some(reached.unix_s - start)
}

/// When the mean of the nodes' latest accuracies first reached `target`, in seconds after the
/// first node started. A node counts from its first evaluation on.
fn time_to_target(statuses: &[&StatusReport], target: f64) -> Option<f64> {
    let start = statuses.iter().map(|s| s.started_unix_s).reduce(f64::min)?;
    let mut events: Vec<(f64, usize, f64)> = statuses
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            s.history
                .iter()
                .map(move |h| (h.unix_s, i, h.test_accuracy))
        })
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut latest: Vec<Option<f64>> = vec![None; statuses.len()];
    for (at, node, accuracy) in events {
        latest[node] = Some(accuracy);
        if latest.iter().all(Option::is_some) {
            let mean = latest.iter().flatten().sum::<f64>() / latest.len() as f64;
            if mean >= target {
                return Some(at - start);
            }
        }
    }
    None
}

pub(super) fn run(args: &EvaluateArgs) -> Result<()> {
    let mut config = RunConfig::load(&args.config)?;
    config.apply_overrides(args.data.as_deref(), None, None)?;
    let test = Dataset::load(&config.data.dir, Split::Test).context("test data")?;
    let backend = select_backend(config.training.device, config.threads())?;
    on_backend!(backend, backend => evaluate_on(args, &config, &test, backend))
}

/// Evaluates the checkpoints on `backend`.
fn evaluate_on<B: Backend>(
    args: &EvaluateArgs,
    config: &RunConfig,
    test: &Dataset,
    backend: B,
) -> Result<()> {
    // Only the trainer's network is used: the test set stands in for training data.
    let mut trainer = Trainer::new(backend, config.train_spec(), test)?;
    let arch = trainer.replica().architecture().clone();
    let fingerprint = arch.fingerprint();
    let mut evaluate =
        |file: PathBuf, node: Option<NodeSummary>| -> Result<(Evaluated, Vec<f32>)> {
            let ckpt = checkpoint::load(&file, arch.layout(), &fingerprint)?;
            let eval = trainer.evaluate_params(&ckpt.params, test)?;
            let evaluated = Evaluated {
                path: file,
                step: ckpt.step,
                test_accuracy: eval.accuracy,
                test_loss: eval.loss,
                node,
            };
            Ok((evaluated, ckpt.params))
        };
    let mut evaluated = Vec::new();
    let mut replicas = Vec::new();
    // Node data dirs come with the daemon's last status; their times count from the first start.
    let statuses = args
        .paths
        .iter()
        .map(|path| {
            if path.is_dir() {
                last_status(path)
            } else {
                Ok(None)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let found: Vec<&StatusReport> = statuses.iter().flatten().collect();
    let start = found.iter().map(|s| s.started_unix_s).reduce(f64::min);
    let start = start.unwrap_or_default();
    let mut center = None;
    for (path, status) in args.paths.iter().zip(&statuses) {
        let node = status.as_ref().map(|s| summarize(s, start, args.target));
        let (e, params) = evaluate(resolve(path)?, node)?;
        evaluated.push(e);
        replicas.push(params);
        let center_file = DataDir::new(path.clone()).center_path();
        if center.is_none() && center_file.is_file() {
            center = Some(evaluate(center_file, None)?.0);
        }
    }
    let views: Vec<&[f32]> = replicas.iter().map(Vec::as_slice).collect();
    let mean_model_test_accuracy = match averaging::mean(&views) {
        Some(mean) if views.len() > 1 => Some(trainer.evaluate_params(&mean, test)?.accuracy),
        _ => None,
    };
    let report = EvaluateReport {
        mean_test_accuracy: evaluated.iter().map(|e| e.test_accuracy).sum::<f64>()
            / evaluated.len().max(1) as f64,
        consensus_distance: (views.len() > 1)
            .then(|| averaging::consensus_distance(&views))
            .flatten(),
        mean_model_test_accuracy,
        checkpoints: evaluated,
        center,
        target: args.target,
        time_to_target_s: args.target.and_then(|t| time_to_target(&found, t)),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_report(&report);
    Ok(())
}

fn print_report(report: &EvaluateReport) {
    println!(
        "{:>8} {:>8} {:>12} {:>10} {:>9} {:>8} {:>10} {:>8} {:>8} {:>8} {:>9}  checkpoint",
        "accuracy",
        "step",
        "bytes sent",
        "B/step",
        "exchanges",
        "gate s",
        "gate max s",
        "stall s",
        "xwait s",
        "timeouts",
        "target s"
    );
    for e in &report.checkpoints {
        let node = e.node.as_ref();
        println!(
            "{:>7.2}% {:>8} {:>12} {:>10} {:>9} {:>8} {:>10} {:>8} {:>8} {:>8} {:>9}  {}",
            e.test_accuracy * 100.0,
            e.step,
            node.map_or("-".into(), |n| n.bytes_out.to_string()),
            node.map_or("-".into(), |n| format!("{:.0}", n.bytes_out_per_step)),
            node.map_or("-".into(), |n| (n.exchanges + n.served).to_string()),
            node.map_or("-".into(), |n| format!("{:.1}", n.gate_wait_s)),
            node.map_or("-".into(), |n| format!("{:.2}", n.longest_gate_wait_s)),
            node.map_or("-".into(), |n| format!("{:.1}", n.longest_stall_s)),
            node.map_or("-".into(), |n| format!("{:.1}", n.exchange_wait_s)),
            node.map_or("-".into(), |n| n.peers_timed_out.to_string()),
            node.and_then(|n| n.reached_target_s)
                .map_or("-".into(), |t| format!("{t:.1}")),
            e.path.display()
        );
    }
    println!(
        "mean test accuracy {:.2}%",
        report.mean_test_accuracy * 100.0
    );
    if let Some(d) = report.consensus_distance {
        println!("consensus distance {d:.3e}");
    }
    if let Some(a) = report.mean_model_test_accuracy {
        println!(
            "mean model accuracy {:.2}% (the replicas' parameters averaged)",
            a * 100.0
        );
    }
    if let Some(c) = &report.center {
        println!(
            "elastic center: test accuracy {:.2}% ({})",
            c.test_accuracy * 100.0,
            c.path.display()
        );
    }
    if let Some(target) = report.target {
        match report.time_to_target_s {
            Some(t) => println!("mean accuracy reached {:.1}% after {t:.1}s", target * 100.0),
            None => println!("mean accuracy never reached {:.1}%", target * 100.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(points: &[(f64, f64)]) -> Vec<AccuracyPoint> {
        let point = |(i, &(unix_s, test_accuracy)): (usize, &(f64, f64))| AccuracyPoint {
            unix_s,
            step: i as u64,
            test_accuracy,
        };
        points.iter().enumerate().map(point).collect()
    }

    #[test]
    fn a_node_reaches_the_target_at_its_first_evaluation_that_meets_it() {
        let points = history(&[(105.0, 0.80), (110.0, 0.871), (115.0, 0.86), (120.0, 0.88)]);
        assert_eq!(first_reached(&points, 100.0, 0.87), Some(10.0));
        assert_eq!(first_reached(&points, 90.0, 0.875), Some(30.0));
        assert_eq!(first_reached(&points, 100.0, 0.9), None);
        assert_eq!(first_reached(&[], 100.0, 0.5), None);
    }
}
