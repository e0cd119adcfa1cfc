//! Poisoning: what one or two adversaries among eight peers do to the honest peers' accuracy,
//! in gossip and in elastic averaging, with the clip rule of decision 0041 and without it (the
//! outlier filter alone, as before the rule), and what the rule costs when nobody attacks.
//!
//! The honest peers are the real trainer (the default MLP on Fashion-MNIST, lr 0.1 with
//! momentum, each on one shard of an 8-way split, IID unless `--dirichlet`), and every
//! exchange runs through the sync crate's protocol machines, the engine's own: the pairwise
//! [`Initiator`] and [`Responder`], and at the center [`answer_worker`] and the [`Worker`]
//! that judges the delta. Their screens are fed as the policy feeds them: a `DistanceFilter`
//! and a `ClipRadius` learning the distances of what was mixed, as credited. The exchanges are
//! rounds in one process, frames handed from one machine to the other instead of streams:
//! every peer trains `interval` steps, then (gossip) random pairs exchange and mix by 0.5, or
//! (elastic) each worker in turn exchanges with the center variable held by an honest peer,
//! `alpha = 0.9 / 8`. As on the wire, the initiator judges first and mixes once it accepts;
//! the responder then judges, and declines on its own.
//!
//! The adversaries are omniscient: they see the mean `m` of the honest replicas and their
//! spread `s` (mean distance from `m`), and send, in every exchange:
//!
//! - `scaled`: `10 m`; `shrunk`: `0.1 m`; `sign-flip`: `-m`;
//! - `steer`: `m + 3 s u`, `u` one fixed random unit direction: a small push, always the same
//!   way, that no distance check tells from an honest replica;
//! - `steer-to-0`: `m - 3 s m / |m|`: `shrunk` made small enough to pass as honest, the
//!   harmful direction at the largest push the clip radius lets through.
//!
//! The baseline of `f` adversaries is the swarm without them: the same `8 - f` honest peers on
//! the same shards. Prints one JSON line per run, then a table.
//!
//! `cargo bench -p murmur-daemon --bench poisoning [-- --epochs N] [--mode gossip|elastic]
//! [--strategy NAME] [--seed N] [--dirichlet ALPHA] [--quick]`: `--seed` (default 0) draws
//! other initial replicas, shards, pairings and steering direction, to tell a rule's effect
//! from one draw's luck; `--dirichlet` deals non-IID shards (each label's shares among the
//! peers drawn from Dirichlet(ALPHA)) instead of IID ones.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use murmur_daemon::config::{NodeConfig, RunConfig};
use murmur_daemon::settings::resolve_sync;
use murmur_protocol::codec::Codec;
use murmur_protocol::mix;
use murmur_protocol::sync::{ClipRadius, ClipRule, DistanceFilter};
use murmur_protocol::wire::MessageKind;
use murmur_sync::machines::elastic::{Worker, answer_worker};
use murmur_sync::machines::pairwise::{Initiator, Responder};
use murmur_sync::machines::{Fed, Head, Lent, Machine, Mixed, feed};
use murmur_sync::policy::Outcome as PolicyOutcome;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::Screen;
use murmur_sync::settings::SyncSettings;
use murmur_trainer::data::{Partition, Samples, Split, shard};
use murmur_trainer::train::TrainError;
use murmur_trainer::{CpuBackend, Dataset, Trainer};
use rand::rngs::ChaCha8Rng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

const PEERS: usize = 8;
const DATA: &str = "/usr/share/datasets/fashion-mnist";
const GOSSIP_INTERVAL: u64 = 8;
const ELASTIC_INTERVAL: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Gossip,
    Elastic,
}

#[derive(Clone, Copy, Debug)]
enum Strategy {
    Scaled,
    Shrunk,
    SignFlip,
    Steer,
    SteerToZero,
}

impl Strategy {
    const ALL: [Strategy; 5] = [
        Strategy::Scaled,
        Strategy::Shrunk,
        Strategy::SignFlip,
        Strategy::Steer,
        Strategy::SteerToZero,
    ];

    fn name(self) -> &'static str {
        match self {
            Strategy::Scaled => "scaled",
            Strategy::Shrunk => "shrunk",
            Strategy::SignFlip => "sign-flip",
            Strategy::Steer => "steer",
            Strategy::SteerToZero => "steer-to-0",
        }
    }

    /// What an adversary sends, from the honest mean `m`, their spread and its direction `u`.
    fn poison(self, m: &[f32], spread: f64, u: &[f32]) -> Vec<f32> {
        match self {
            Strategy::Scaled => m.iter().map(|v| 10.0 * v).collect(),
            Strategy::Shrunk => m.iter().map(|v| 0.1 * v).collect(),
            Strategy::SignFlip => m.iter().map(|v| -v).collect(),
            Strategy::Steer => {
                let push = (3.0 * spread) as f32;
                m.iter().zip(u).map(|(v, d)| v + push * d).collect()
            }
            Strategy::SteerToZero => {
                let push = (3.0 * spread / mix::norm(m)) as f32;
                m.iter().map(|v| v - push * v).collect()
            }
        }
    }
}

/// One run: `adversaries` of the peers (the first ones) play `strategy`, the others train.
#[derive(Clone, Copy, Debug)]
struct Run {
    mode: Mode,
    /// Peers in the swarm, adversaries included.
    peers: usize,
    adversaries: usize,
    strategy: Option<Strategy>,
    rule: bool,
}

/// What an honest peer judges received parameters (or deltas) by, as the policy's judge.
struct Judge {
    filter: DistanceFilter,
    clip: ClipRadius<usize>,
    rule: ClipRule,
}

impl Judge {
    fn new(rule: ClipRule) -> Self {
        Judge {
            filter: DistanceFilter::default(),
            clip: ClipRadius::new(rule.factor),
            rule,
        }
    }

    /// The screen (without the rule: the outlier filter alone).
    fn screen(&self, rule: bool) -> Screen {
        Screen {
            limit: self.filter.limit(),
            radius: if rule {
                self.clip.radius(Instant::now())
            } else {
                Some(f64::INFINITY)
            },
            knee: self.rule.knee,
            radial: if rule {
                self.rule.radial
            } else {
                f64::INFINITY
            },
        }
    }

    /// Learns from a mix's outcome, as the policy does.
    fn mixed(&mut self, from: usize, outcome: PolicyOutcome) {
        if let PolicyOutcome::Mixed { distance, credited } = outcome {
            self.filter.record(distance);
            self.clip.record(&from, credited, Instant::now());
        }
    }
}

struct Honest {
    trainer: Trainer<CpuBackend>,
    /// Training diverged (the daemon would leave the swarm with an error): it stops here.
    diverged: bool,
    shard: Samples,
    params: Judge,
    deltas: Judge,
}

#[derive(Default)]
struct Tally {
    clipped: u64,
    declined: u64,
}

impl Tally {
    /// A side's judgement of what it received: the mix it takes (counted, and learnt by its
    /// `judge` as coming `from`), or `None` when it declined.
    fn judged(
        &mut self,
        judge: &mut Judge,
        from: usize,
        judged: Result<Mixed, PolicyOutcome>,
    ) -> Option<ExchangeEnd> {
        match judged {
            Ok(mixed) => {
                self.clipped += u64::from(mixed.clipped);
                judge.mixed(from, mixed.outcome);
                Some(mixed.end)
            }
            Err(_) => {
                self.declined += 1;
                None
            }
        }
    }
}

/// A replica's snapshot for a machine, taken at `step`.
fn snapshot(step: u64, params: &[f32]) -> Arc<Snapshot> {
    Arc::new(Snapshot {
        step,
        params: params.to_vec(),
    })
}

/// `replica` with an exchange's end landed on it, as the replica loop lands it.
fn landed(replica: &[f32], end: ExchangeEnd) -> Vec<f32> {
    let mut x = replica.to_vec();
    match end {
        ExchangeEnd::Mix { delta, weight } => {
            // Dense exchanges: the mix is its values.
            let mut delta = delta.into_values().expect("a dense mix's values");
            mix::scale(&mut delta, weight);
            mix::add(&mut x, &delta);
        }
        ExchangeEnd::Subtract(delta) => mix::subtract(&mut x, &delta),
        end => panic!("a pairwise or elastic exchange ends in a mix, not {end:?}"),
    }
    x
}

struct Outcome {
    /// Over the honest peers; one that diverged counts as it ended (about 10 %, chance).
    mean: f64,
    min: f64,
    diverged: usize,
    tally: Tally,
    secs: f64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number = |flag: &str| {
        only(flag).map(|v| {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("{flag} takes a number"))
        })
    };
    let epochs = number("--epochs").unwrap_or(if quick { 1 } else { 5 });
    let seed = number("--seed").unwrap_or(0);
    let dir = Path::new(DATA);
    let train = Dataset::load(dir, Split::Train)
        .unwrap_or_else(|e| panic!("{e}: install Fashion-MNIST (docs/operations.md)"));
    let test =
        Samples::Images(Dataset::load(dir, Split::Test).expect("the Fashion-MNIST test set"));
    // `--dirichlet ALPHA`: non-IID shards, each label's shares drawn from Dirichlet(ALPHA).
    let partition = only("--dirichlet").map_or(Partition::Iid, |alpha| Partition::Dirichlet {
        alpha: alpha
            .parse()
            .unwrap_or_else(|_| panic!("--dirichlet takes a number")),
    });
    let shards: Vec<Samples> = shard::assign(train.labels(), PEERS, partition, seed)
        .expect("8 shards")
        .iter()
        .map(|indices| Samples::Images(train.subset(indices)))
        .collect();
    let strategies: Vec<Strategy> = Strategy::ALL
        .into_iter()
        .filter(|s| match only("--strategy") {
            Some(name) => s.name() == name,
            None => !quick || matches!(s, Strategy::SignFlip),
        })
        .collect();
    let modes: Vec<Mode> = [Mode::Gossip, Mode::Elastic]
        .into_iter()
        .filter(|m| only("--mode").is_none_or(|name| format!("{m:?}").eq_ignore_ascii_case(&name)))
        .collect();
    let mut rows = Vec::new();
    for mode in modes {
        let mut runs = vec![Run {
            mode,
            peers: PEERS,
            adversaries: 0,
            strategy: None,
            rule: false,
        }];
        for adversaries in [0, 1, 2] {
            runs.push(Run {
                mode,
                peers: PEERS - adversaries,
                adversaries: 0,
                strategy: None,
                rule: true,
            });
        }
        for adversaries in [1, 2] {
            for &strategy in &strategies {
                for rule in [false, true] {
                    runs.push(Run {
                        mode,
                        peers: PEERS,
                        adversaries,
                        strategy: Some(strategy),
                        rule,
                    });
                }
            }
        }
        for run in runs {
            let outcome = play(run, epochs, seed, &shards, &test);
            println!(
                "{}",
                serde_json::json!({
                    "mode": format!("{:?}", run.mode).to_lowercase(),
                    "peers": run.peers,
                    "adversaries": run.adversaries,
                    "strategy": run.strategy.map_or("none", Strategy::name),
                    "rule": run.rule,
                    "epochs": epochs,
                    "seed": seed,
                    "dirichlet": only("--dirichlet"),
                    "honest_accuracy_mean": outcome.mean,
                    "honest_accuracy_min": outcome.min,
                    "diverged": outcome.diverged,
                    "clipped": outcome.tally.clipped,
                    "declined": outcome.tally.declined,
                    "secs": outcome.secs,
                })
            );
            rows.push((run, outcome));
        }
    }
    print_table(&rows);
}

/// Trains the honest peers of `run` to the end of their epochs; their test accuracy.
fn play(run: Run, epochs: u64, seed: u64, shards: &[Samples], test: &Samples) -> Outcome {
    let started = Instant::now();
    let config = format!(
        "[run]\nname = \"poisoning\"\nseed = {seed}\n[model]\nkind = \"mlp\"\n\
         [optimizer]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\nschedule = \"warmup_cosine\"\n\
         warmup_steps = 120\n[training]\nepochs = {epochs}\nbatch_size = 64\n"
    );
    let run_config =
        RunConfig::parse(Path::new("poisoning.toml"), &config).expect("the bench's run config");
    let spec = run_config
        .train_spec()
        .expect("the bench's run config has a model");
    // The machines' rules (the mix bound, age weighting) as a node of the run has them.
    let settings =
        resolve_sync(&run_config, &NodeConfig::default()).expect("the bench's sync settings");
    // The first `adversaries` peers attack; a swarm without them keeps the others' shards.
    let first_honest = PEERS - (run.peers - run.adversaries);
    let mut honest: Vec<Honest> = shards[first_honest..]
        .iter()
        .map(|shard| Honest {
            trainer: Trainer::new(CpuBackend::new(), spec.clone(), shard).expect("a trainer"),
            diverged: false,
            shard: shard.clone(),
            // As the policy's: pairwise partners in gossip, workers at the center in elastic.
            params: Judge::new(match run.mode {
                Mode::Gossip => ClipRule::PAIRWISE,
                Mode::Elastic => ClipRule::CENTER,
            }),
            deltas: Judge::new(ClipRule::CENTER),
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(7 + seed);
    let dim = honest[0].trainer.params().expect("parameters").len();
    let mut direction: Vec<f32> = (0..dim).map(|_| rng.random_range(-1.0..1.0)).collect();
    let length = mix::norm(&direction) as f32;
    mix::scale(&mut direction, 1.0 / length);
    let mut center = honest[0].trainer.params().expect("parameters");
    let interval = match run.mode {
        Mode::Gossip => GOSSIP_INTERVAL,
        Mode::Elastic => ELASTIC_INTERVAL,
    };
    let mut tally = Tally::default();
    // The clock every honest replica's snapshots carry: all step together, so no exchange is
    // weighted for staleness.
    let mut step = 0;
    while !honest.iter().all(|h| h.trainer.is_finished() || h.diverged) {
        step += interval;
        train(&mut honest, interval);
        let replicas: Vec<Vec<f32>> = honest
            .iter()
            .map(|h| h.trainer.params().expect("parameters"))
            .collect();
        let round = Round::new(run, &settings, step, &replicas, &honest, &direction);
        let mut order: Vec<usize> = (0..run.peers).collect();
        order.shuffle(&mut rng);
        match run.mode {
            Mode::Gossip => round.gossip(&order, &mut honest, &mut tally),
            Mode::Elastic => round.elastic(&order, &mut center, &mut honest, &mut tally),
        }
    }
    let accuracies: Vec<f64> = honest
        .iter_mut()
        // A diverged replica's evaluation may fail on its NaN loss: it is as good as no model.
        .map(|h| h.trainer.evaluate(test).map_or(0.0, |e| e.accuracy))
        .collect();
    Outcome {
        mean: accuracies.iter().sum::<f64>() / accuracies.len() as f64,
        min: accuracies.iter().copied().fold(f64::INFINITY, f64::min),
        diverged: honest.iter().filter(|h| h.diverged).count(),
        tally,
        secs: started.elapsed().as_secs_f64(),
    }
}

/// Every honest replica still training takes `interval` steps on its shard.
fn train(honest: &mut [Honest], interval: u64) {
    for h in honest {
        for _ in 0..interval {
            if h.trainer.is_finished() || h.diverged {
                break;
            }
            match h.trainer.train_step(&h.shard) {
                Ok(_) => {}
                Err(TrainError::Diverged { .. }) => h.diverged = true,
                Err(e) => panic!("a training step: {e}"),
            }
        }
    }
}

/// One round of exchanges: the honest replicas at `step`, and what the adversaries send.
struct Round<'a> {
    run: Run,
    settings: &'a SyncSettings,
    step: u64,
    replicas: &'a [Vec<f32>],
    /// What every adversary sends this round, aimed at the replicas still training.
    poison: Option<Vec<f32>>,
}

impl<'a> Round<'a> {
    fn new(
        run: Run,
        settings: &'a SyncSettings,
        step: u64,
        replicas: &'a [Vec<f32>],
        honest: &[Honest],
        direction: &[f32],
    ) -> Self {
        let poison = run.strategy.map(|strategy| {
            let views: Vec<&[f32]> = replicas
                .iter()
                .zip(honest)
                .filter(|(_, h)| !h.diverged)
                .map(|(r, _)| r.as_slice())
                .collect();
            let mean = mix::mean(&views).expect("replicas of one length");
            let spread =
                views.iter().map(|r| mix::distance(r, &mean)).sum::<f64>() / views.len() as f64;
            strategy.poison(&mean, spread, direction)
        });
        Round {
            run,
            settings,
            step,
            replicas,
            poison,
        }
    }

    /// Peer `p`'s place among the honest peers; `None` for an adversary.
    fn honest_index(&self, p: usize) -> Option<usize> {
        p.checked_sub(self.run.adversaries)
    }

    /// What `peer` sends: its replica, or the poison if it is an adversary.
    fn sent(&self, peer: usize) -> Vec<f32> {
        match self.honest_index(peer) {
            Some(i) => self.replicas[i].clone(),
            None => (self.poison.clone()).expect("an adversary has a strategy"),
        }
    }

    fn screen(&self, judge: &Judge) -> Screen {
        judge.screen(self.run.rule)
    }

    /// Gossip: the peers in `order`, two by two, exchange and mix by 0.5.
    fn gossip(&self, order: &[usize], honest: &mut [Honest], tally: &mut Tally) {
        let step = self.step;
        for pair in order.chunks_exact(2) {
            let (a, b) = (pair[0], pair[1]);
            // The initiator `a` offers; an adversary's frames are what it likes.
            let mut initiator = self.honest_index(a).map(|i| {
                let snapshot = snapshot(step, &self.replicas[i]);
                let screen = self.screen(&honest[i].params);
                Initiator::new(self.settings, snapshot, Codec::F32, 0.5, screen, None)
            });
            let offer = initiator.as_ref().map_or_else(
                || Head::new(MessageKind::Offer, step),
                |machine| machine.start().remove(0).0,
            );
            let mut responder = self.honest_index(b).map(|i| {
                let snapshot = snapshot(step, &self.replicas[i]);
                let screen = self.screen(&honest[i].params);
                Responder::new(self.settings, &offer, snapshot, 0.5, screen, None)
            });
            let answer = Head::new(MessageKind::Params, step);
            // The initiator judges the responder's parameters first and mixes once it
            // accepts; declining, it tells the responder, which does not mix.
            if let (Some(machine), Some(i)) = (initiator.as_mut(), self.honest_index(a)) {
                let frames = vec![(answer, self.sent(b))];
                let Fed {
                    sent: ours,
                    end: judged,
                    ..
                } = feed(machine, frames, false, &mut Lent::default());
                assert_eq!(ours[0].0.codec, Codec::F32, "a dense exchange");
                let judged = judged.expect("the initiator is done once the answer is in");
                match tally.judged(&mut honest[i].params, b, judged) {
                    Some(end) => honest[i]
                        .trainer
                        .set_params(&landed(&self.replicas[i], end))
                        .expect("a mix"),
                    None => continue,
                }
            }
            if let (Some(machine), Some(i)) = (responder.as_mut(), self.honest_index(b)) {
                // The initiator's parameters, then the stream's end: it mixed.
                let frames = vec![(Head::new(MessageKind::Params, step), self.sent(a))];
                let judged = feed(machine, frames, true, &mut Lent::default()).end;
                let judged = judged.expect("the responder is done once the stream ended");
                if let Some(end) = tally.judged(&mut honest[i].params, a, judged) {
                    honest[i]
                        .trainer
                        .set_params(&landed(&self.replicas[i], end))
                        .expect("a mix");
                }
            }
        }
    }

    /// Elastic averaging: each peer in `order` in turn moves the `center`, held by the first
    /// honest peer, and takes the delta back.
    fn elastic(
        &self,
        order: &[usize],
        center: &mut [f32],
        honest: &mut [Honest],
        tally: &mut Tally,
    ) {
        let (run, step) = (self.run, self.step);
        let alpha = 0.9 / run.peers as f32;
        let holder = 0; // the first honest peer holds the center
        for &w in order {
            let worker = self.sent(w);
            let delta = if w == run.adversaries + holder {
                // The holder's own replica moves the center without a request.
                mix::elastic_step(center, &worker, alpha)
            } else {
                let judge = &mut honest[holder].params;
                let answered = answer_worker(
                    self.settings,
                    center,
                    step,
                    (step, worker),
                    alpha,
                    judge.screen(run.rule),
                );
                match answered {
                    Ok(answered) => {
                        tally.clipped += u64::from(answered.clipped);
                        judge.mixed(w, answered.outcome);
                        answered.delta
                    }
                    Err(_) => {
                        tally.declined += 1;
                        continue;
                    }
                }
            };
            let Some(i) = self.honest_index(w) else {
                continue;
            };
            let own = &self.replicas[i];
            let end = if i == holder {
                ExchangeEnd::Subtract(delta)
            } else {
                let screen = self.screen(&honest[i].deltas);
                let mut machine = Worker::new(self.settings, snapshot(step, own), screen);
                let frames = vec![(Head::new(MessageKind::Delta, step), delta)];
                let judged = feed(&mut machine, frames, true, &mut Lent::default()).end;
                let judged = judged.expect("a worker is done once the answer is in");
                match tally.judged(&mut honest[i].deltas, holder, judged) {
                    Some(end) => end,
                    None => continue,
                }
            };
            honest[i]
                .trainer
                .set_params(&landed(own, end))
                .expect("an elastic step");
        }
    }
}

/// The runs side by side: each attack next to the swarm without its adversaries.
fn print_table(rows: &[(Run, Outcome)]) {
    println!(
        "\n{:<8} {:>4} {:<10} {:>5} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "mode",
        "adv",
        "strategy",
        "rule",
        "mean %",
        "min %",
        "vs base",
        "diverged",
        "clipped",
        "declined"
    );
    for (run, outcome) in rows {
        let base = rows.iter().find(|(b, _)| {
            b.mode == run.mode
                && b.strategy.is_none()
                && b.rule
                && b.peers == run.peers - run.adversaries
        });
        let versus = base.map_or(String::from("-"), |(_, b)| {
            format!("{:+.2}", 100.0 * (outcome.mean - b.mean))
        });
        println!(
            "{:<8} {:>4} {:<10} {:>5} {:>9.2} {:>9.2} {:>9} {:>8} {:>8} {:>8}",
            format!("{:?}", run.mode).to_lowercase(),
            run.adversaries,
            run.strategy.map_or("none", Strategy::name),
            if run.rule { "on" } else { "off" },
            100.0 * outcome.mean,
            100.0 * outcome.min,
            versus,
            outcome.diverged,
            outcome.tally.clipped,
            outcome.tally.declined,
        );
    }
}
