//! `nodectl evaluate`: test accuracy of checkpoints, their consensus distance, and (for node
//! data dirs) what each daemon did during the run.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use murmur_protocol::mix;
use murmur_trainer::checkpoint;
use murmur_trainer::data::Samples;
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
    /// Whether the model is a language model: its figure is the validation loss, and
    /// `target` a loss to fall to (its accuracy is that of next-token guesses).
    language_model: bool,
    checkpoints: Vec<Evaluated>,
    mean_test_accuracy: f64,
    mean_test_loss: f64,
    /// `max_i ||x_i - mean|| / ||mean||` over the checkpoints (with two or more).
    consensus_distance: Option<f64>,
    /// Test accuracy and loss of the mean of the checkpoints' parameters (with two or more):
    /// what one final all-reduce would give.
    mean_model_test_accuracy: Option<f64>,
    mean_model_test_loss: Option<f64>,
    /// The elastic center found in a node's checkpoint directory.
    center: Option<Evaluated>,
    target: Option<f64>,
    /// Seconds from the first node's start until the mean of the nodes' latest test
    /// accuracies (losses, for a language model) first reached `target`.
    time_to_target_s: Option<f64>,
}

/// The checkpoint file a PATH names.
pub(super) fn resolve(path: &Path) -> Result<PathBuf> {
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
fn summarize(s: &StatusReport, start: f64, target: Option<Target>) -> NodeSummary {
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

/// What `--target` asks of a run: a test accuracy to rise to, or for a language model a
/// validation loss to fall to.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Target {
    Accuracy(f64),
    Loss(f64),
}

impl Target {
    /// The figure of an evaluation that the target reads.
    fn value(self, point: &AccuracyPoint) -> Option<f64> {
        match self {
            Target::Accuracy(_) => Some(point.test_accuracy),
            Target::Loss(_) => point.test_loss,
        }
    }

    fn met_by(self, value: f64) -> bool {
        match self {
            Target::Accuracy(target) => value >= target,
            Target::Loss(target) => value <= target,
        }
    }
}

/// When `history` first reached `target`, in seconds after `start`.
fn first_reached(history: &[AccuracyPoint], start: f64, target: Target) -> Option<f64> {
    let reached = history
        .iter()
        .find(|h| target.value(h).is_some_and(|v| target.met_by(v)))?;
    Some(reached.unix_s - start)
}

/// When the mean of the nodes' latest figures first reached `target`, in seconds after the
/// first node started. A node counts from its first evaluation on.
fn time_to_target(statuses: &[&StatusReport], target: Target) -> Option<f64> {
    let start = statuses.iter().map(|s| s.started_unix_s).reduce(f64::min)?;
    let mut events: Vec<(f64, usize, f64)> = statuses
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            s.history
                .iter()
                .filter_map(move |h| Some((h.unix_s, i, target.value(h)?)))
        })
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut latest: Vec<Option<f64>> = vec![None; statuses.len()];
    for (at, node, value) in events {
        latest[node] = Some(value);
        if latest.iter().all(Option::is_some) {
            let mean = latest.iter().flatten().sum::<f64>() / latest.len() as f64;
            if target.met_by(mean) {
                return Some(at - start);
            }
        }
    }
    None
}

pub(super) fn run(args: &EvaluateArgs) -> Result<()> {
    let mut config = RunConfig::load(&args.config)?;
    config.apply_overrides(args.data.as_deref(), None, None)?;
    if config.model.is_none() {
        return evaluate_reported(args, &config);
    }
    // Only the test samples are used: they also stand in for training data below.
    let (_, test) = super::samples::load(&config)?;
    let backend = select_backend(config.training.device, config.threads())?;
    on_backend!(backend, backend => evaluate_on(args, &config, &test, backend))
}

/// Evaluates the checkpoints on `backend`.
fn evaluate_on<B: Backend>(
    args: &EvaluateArgs,
    config: &RunConfig,
    test: &Samples,
    backend: B,
) -> Result<()> {
    // Only the trainer's network is used: the test set stands in for training data.
    let mut trainer = Trainer::new(backend, config.train_spec()?, test)?;
    let language_model = matches!(test, Samples::Text(_));
    let target = args.target.map(if language_model {
        Target::Loss
    } else {
        Target::Accuracy
    });
    let (layout, fingerprint) = (trainer.layout().clone(), trainer.fingerprint().to_owned());
    let mut evaluate =
        |file: PathBuf, node: Option<NodeSummary>| -> Result<(Evaluated, Vec<f32>)> {
            let ckpt = checkpoint::load(&file, &layout, &fingerprint)?;
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
        let node = status.as_ref().map(|s| summarize(s, start, target));
        let (e, params) = evaluate(resolve(path)?, node)?;
        evaluated.push(e);
        replicas.push(params);
        let center_file = DataDir::new(path.clone()).center_path();
        if center.is_none() && center_file.is_file() {
            center = Some(evaluate(center_file, None)?.0);
        }
    }
    let views: Vec<&[f32]> = replicas.iter().map(Vec::as_slice).collect();
    let mean_model = match mix::mean(&views) {
        Some(mean) if views.len() > 1 => Some(trainer.evaluate_params(&mean, test)?),
        _ => None,
    };
    let mean_of = |figure: fn(&Evaluated) -> f64| {
        evaluated.iter().map(figure).sum::<f64>() / evaluated.len().max(1) as f64
    };
    let report = EvaluateReport {
        language_model,
        mean_test_accuracy: mean_of(|e| e.test_accuracy),
        mean_test_loss: mean_of(|e| e.test_loss),
        consensus_distance: (views.len() > 1)
            .then(|| mix::consensus_distance(&views))
            .flatten(),
        mean_model_test_accuracy: mean_model.map(|e| e.accuracy),
        mean_model_test_loss: mean_model.map(|e| e.loss),
        checkpoints: evaluated,
        center,
        target: args.target,
        time_to_target_s: target.and_then(|t| time_to_target(&found, t)),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_report(&report);
    Ok(())
}

/// A run whose peers bring their own model (PyTorch): nodectl cannot run it, so each node's
/// figures are those it reported at its last evaluation (its `last-status.json`), and the
/// checkpoints give the consensus distance; the mean model is not evaluated.
fn evaluate_reported(args: &EvaluateArgs, config: &RunConfig) -> Result<()> {
    let language_model = config.reads_text();
    let target = args.target.map(if language_model {
        Target::Loss
    } else {
        Target::Accuracy
    });
    let mut statuses = Vec::new();
    for path in &args.paths {
        let status = path
            .is_dir()
            .then(|| last_status(path))
            .transpose()?
            .flatten();
        let Some(status) = status else {
            bail!(
                "`{}` has no last status: run `{}` trains its peers' own model, which nodectl \
                 cannot evaluate, so it reads what each node reported; pass the data dirs of \
                 nodes that have left",
                path.display(),
                config.name()
            );
        };
        statuses.push(status);
    }
    let found: Vec<&StatusReport> = statuses.iter().collect();
    let start = found.iter().map(|s| s.started_unix_s).reduce(f64::min);
    let start = start.unwrap_or_default();
    let mut evaluated = Vec::new();
    let mut replicas = Vec::new();
    for (path, status) in args.paths.iter().zip(&statuses) {
        let file = resolve(path)?;
        let (ckpt, _) = checkpoint::load_any(&file)?;
        let last = status.history.last();
        evaluated.push(Evaluated {
            path: file,
            step: ckpt.step,
            test_accuracy: last.map_or(f64::NAN, |p| p.test_accuracy),
            test_loss: last.and_then(|p| p.test_loss).unwrap_or(f64::NAN),
            node: Some(summarize(status, start, target)),
        });
        replicas.push(ckpt.params);
    }
    let views: Vec<&[f32]> = replicas.iter().map(Vec::as_slice).collect();
    let same_model = views.windows(2).all(|pair| pair[0].len() == pair[1].len());
    let mean_of = |figure: fn(&Evaluated) -> f64| {
        evaluated.iter().map(figure).sum::<f64>() / evaluated.len().max(1) as f64
    };
    let report = EvaluateReport {
        language_model,
        mean_test_accuracy: mean_of(|e| e.test_accuracy),
        mean_test_loss: mean_of(|e| e.test_loss),
        consensus_distance: (views.len() > 1 && same_model)
            .then(|| mix::consensus_distance(&views))
            .flatten(),
        mean_model_test_accuracy: None,
        mean_model_test_loss: None,
        checkpoints: evaluated,
        center: None,
        target: args.target,
        time_to_target_s: target.and_then(|t| time_to_target(&found, t)),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(report: &EvaluateReport) {
    // A language model is judged by its validation loss, an image model by its accuracy.
    let (figure, show): (&str, fn(&Evaluated) -> String) = if report.language_model {
        ("val loss", |e| format!("{:>8.4}", e.test_loss))
    } else {
        ("accuracy", |e| format!("{:>7.2}%", e.test_accuracy * 100.0))
    };
    println!(
        "{figure:>8} {:>8} {:>12} {:>10} {:>9} {:>8} {:>10} {:>8} {:>8} {:>8} {:>9}  checkpoint",
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
            "{} {:>8} {:>12} {:>10} {:>9} {:>8} {:>10} {:>8} {:>8} {:>8} {:>9}  {}",
            show(e),
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
    if report.language_model {
        print_language_model_summary(report);
    } else {
        print_accuracy_summary(report);
    }
}

fn print_accuracy_summary(report: &EvaluateReport) {
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

fn print_language_model_summary(report: &EvaluateReport) {
    println!(
        "mean validation loss {:.4} (next-token accuracy {:.2}%)",
        report.mean_test_loss,
        report.mean_test_accuracy * 100.0
    );
    if let Some(d) = report.consensus_distance {
        println!("consensus distance {d:.3e}");
    }
    if let Some(loss) = report.mean_model_test_loss {
        println!("mean model validation loss {loss:.4} (the replicas' parameters averaged)");
    }
    if let Some(c) = &report.center {
        println!(
            "elastic center: validation loss {:.4} ({})",
            c.test_loss,
            c.path.display()
        );
    }
    if let Some(target) = report.target {
        match report.time_to_target_s {
            Some(t) => println!("mean validation loss reached {target} after {t:.1}s"),
            None => println!("mean validation loss never reached {target}"),
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
            test_loss: None,
        };
        points.iter().enumerate().map(point).collect()
    }

    #[test]
    fn a_node_reaches_the_target_at_its_first_evaluation_that_meets_it() {
        let points = history(&[(105.0, 0.80), (110.0, 0.871), (115.0, 0.86), (120.0, 0.88)]);
        let at_least = Target::Accuracy;
        assert_eq!(first_reached(&points, 100.0, at_least(0.87)), Some(10.0));
        assert_eq!(first_reached(&points, 90.0, at_least(0.875)), Some(30.0));
        assert_eq!(first_reached(&points, 100.0, at_least(0.9)), None);
        assert_eq!(first_reached(&[], 100.0, at_least(0.5)), None);
    }

    #[test]
    fn a_loss_target_is_reached_by_falling_to_it() {
        let mut points = history(&[(105.0, 0.3), (110.0, 0.4), (115.0, 0.45)]);
        for (point, loss) in points.iter_mut().zip([2.5, 1.95, 1.9]) {
            point.test_loss = Some(loss);
        }
        assert_eq!(first_reached(&points, 100.0, Target::Loss(2.0)), Some(10.0));
        assert_eq!(first_reached(&points, 100.0, Target::Loss(1.9)), Some(15.0));
        assert_eq!(first_reached(&points, 100.0, Target::Loss(1.8)), None);
    }
}
