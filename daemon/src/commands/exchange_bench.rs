//! `nodectl bench exchange`: one pairwise exchange of a model of N parameters, stage by stage,
//! as a node runs it: the sync crate's protocol machines ([`Initiator`], [`Responder`]) on the
//! pair's copies, their frames written and read by the wire's own functions (header, checksum,
//! decoding), and the mix that lands on the replica. Both sides run in this process, one after
//! the other, with the bytes of a frame handed over in memory instead of a stream: what is
//! timed is the work a node does around the link, to set against the time the encoded bytes
//! take on it (`nodectl bench transfer` measures a link).
//!
//! For each N it prints the time of every stage (the median over `--rounds` exchanges on the
//! same pair, so that the copies are warm), the bytes each side sends, and the memory the
//! exchange took above the two replicas and their copies (the allocator's exact count).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::AsyncWrite;
use futures::executor::block_on;
use futures::io::Cursor;
use murmur_protocol::codec::Codec;
use murmur_protocol::mix;
use murmur_protocol::wire::{self, Expect, TensorHeader, WireError};
use murmur_sync::copies::{Copies, Gauge};
use murmur_sync::machines::pairwise::{Initiator, Responder};
use murmur_sync::machines::{Head, Lent, Machine, Payload, Turn};
use murmur_sync::replica::{Delta, ExchangeEnd, Snapshot};
use murmur_sync::screen::Screen;
use murmur_sync::settings::SyncSettings;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use crate::allocator;
use crate::cli::BenchExchangeArgs;
use crate::config::{NodeConfig, RunConfig};
use crate::report::{self, round};
use crate::settings::resolve_sync;

mod network;

const RUN: &str = "bench-exchange";
const MODEL: &str = "bench-model";

/// The stages of one side's exchange, in the order it runs them.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Stages {
    /// The difference against the pair's copy, encoded (a dense exchange: none).
    difference_s: f64,
    /// The frame written: header, checksum, bytes.
    write_s: f64,
    /// The partner's frame read: header checked, checksum, decoded.
    read_s: f64,
    /// The partner's values judged (finite, gap, outlier, clip) and the copies committed.
    judge_s: f64,
    /// The mix landed on the replica.
    mix_s: f64,
}

impl Stages {
    fn total(&self) -> f64 {
        self.difference_s + self.write_s + self.read_s + self.judge_s + self.mix_s
    }

    /// Each stage's median over `rounds`.
    fn median(rounds: &[Stages]) -> Stages {
        let of = |f: fn(&Stages) -> f64| median(rounds.iter().map(f).collect());
        Stages {
            difference_s: of(|s| s.difference_s),
            write_s: of(|s| s.write_s),
            read_s: of(|s| s.read_s),
            judge_s: of(|s| s.judge_s),
            mix_s: of(|s| s.mix_s),
        }
    }
}

/// One model size's figures.
#[derive(Debug, Serialize)]
struct Figures {
    bench: &'static str,
    params: usize,
    codec: String,
    /// The model's bytes in `f32`.
    model_bytes: u64,
    /// Bytes of one side's parameter frame (header included).
    frame_bytes: u64,
    /// The initiator's stages (the responder's are the same work in another order).
    stages: Stages,
    /// One side's stages summed: what a node spends on an exchange besides the link.
    side_s: f64,
    /// Medians over this many exchanges.
    rounds: usize,
    /// The most memory the exchange held at once above the two replicas and their copies,
    /// both sides together, and as a multiple of the model's bytes per side.
    peak_extra_bytes: Option<u64>,
    peak_extra_per_side_models: Option<f64>,
}

pub(super) fn run(args: &BenchExchangeArgs) -> Result<()> {
    if args.rounds == 0 || args.params.contains(&0) {
        bail!("--rounds and every --params must be positive");
    }
    let settings = settings(&args.codec)?;
    if let Some(transport) = &args.transport {
        let loopback = super::transfer::listen_addr(transport)?;
        if args.serve {
            let listen = match &args.listen {
                Some(addr) => super::transfer::address_of(transport, addr, "--listen")?,
                None => loopback,
            };
            return network::serve(args, &settings, listen);
        }
        for &params in &args.params {
            network::run(args, transport, &settings, params)
                .with_context(|| format!("the exchange of {params} parameters"))?;
        }
        return Ok(());
    }
    for &params in &args.params {
        let figures = bench(&settings, &args.codec, params, args.rounds, args.seed)
            .with_context(|| format!("the exchange of {params} parameters"))?;
        if args.json {
            println!("{}", serde_json::to_string(&figures)?);
        } else {
            print(&figures);
        }
    }
    Ok(())
}

/// The sync settings of a gossip run with `codec`, as a node resolves them from its config.
fn settings(codec: &str) -> Result<SyncSettings> {
    let text = format!(
        "[training]\nepochs = 1\nbatch_size = 1\n[sync]\nmode = \"gossip\"\ncodec = {codec:?}\n"
    );
    let config = RunConfig::parse(std::path::Path::new("--codec"), &text)?;
    resolve_sync(&config, &NodeConfig::default())
}

/// One side: its replica and the pair's copies as it holds them.
struct Side {
    replica: Vec<f32>,
    copies: Copies,
}

fn bench(
    settings: &SyncSettings,
    codec: &str,
    params: usize,
    rounds: usize,
    seed: u64,
) -> Result<Figures> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let replica = |rng: &mut ChaCha8Rng| -> Vec<f32> {
        (0..params).map(|_| rng.random_range(-0.1..0.1)).collect()
    };
    let mut a = Side {
        replica: replica(&mut rng),
        copies: Copies::fresh(params),
    };
    let mut b = Side {
        replica: replica(&mut rng),
        copies: Copies::fresh(params),
    };
    let mut stages = Vec::with_capacity(rounds);
    let mut frame_bytes = 0;
    let mut peak_extra: Option<u64> = None;
    // A first exchange warms the copies (and the allocator); then the timed ones.
    for round in 0..=rounds {
        let before = allocator::held_bytes();
        allocator::reset_peak();
        let (timed, bytes) = exchange(settings, &mut a, &mut b, round as u64)?;
        if let (Some(before), Some(peak)) = (before, allocator::peak_bytes()) {
            let extra = peak.saturating_sub(before);
            peak_extra = Some(peak_extra.map_or(extra, |p| p.max(extra)));
        }
        if round > 0 {
            stages.push(timed);
            frame_bytes = bytes;
        }
    }
    let stages = Stages::median(&stages);
    let model_bytes = (params * std::mem::size_of::<f32>()) as u64;
    Ok(Figures {
        bench: "exchange",
        params,
        codec: codec.to_owned(),
        model_bytes,
        frame_bytes,
        side_s: round(stages.total(), 4),
        stages: Stages {
            difference_s: round(stages.difference_s, 4),
            write_s: round(stages.write_s, 4),
            read_s: round(stages.read_s, 4),
            judge_s: round(stages.judge_s, 4),
            mix_s: round(stages.mix_s, 4),
        },
        rounds,
        peak_extra_bytes: peak_extra,
        peak_extra_per_side_models: peak_extra
            .map(|extra| round(extra as f64 / 2.0 / model_bytes as f64, 2)),
    })
}

/// One exchange, `a` offering to `b`, each side's machine fed the other's frames through the
/// wire: the initiator's stages, and the bytes of its parameter frame.
fn exchange(
    settings: &SyncSettings,
    a: &mut Side,
    b: &mut Side,
    step: u64,
) -> Result<(Stages, u64)> {
    let mut stages = Stages::default();
    let snapshot = |side: &Side| {
        Arc::new(Snapshot {
            step,
            params: side.replica.clone(),
        })
    };
    let compressed = settings.codec != Codec::F32;
    let (snap_a, snap_b) = (snapshot(a), snapshot(b));
    let mut initiator = Initiator::new(
        settings,
        snap_a,
        settings.codec,
        0.5,
        Screen::default(),
        compressed.then_some(&a.copies),
    );
    let offer = initiator.start().remove(0).0;
    // The initiator works its difference out while the responder makes its answer.
    let mut lent = Lent::copies(compressed.then_some(&mut a.copies));
    let started = Instant::now();
    initiator.work_ahead(&mut lent);
    stages.difference_s = started.elapsed().as_secs_f64();
    let mut responder = Responder::new(
        settings,
        &offer,
        snap_b,
        0.5,
        Screen::default(),
        compressed.then_some(&mut b.copies),
    );
    // The responder's answer (its difference) on the wire.
    let answer = frame(&responder.start()[0])?;

    // The initiator: the answer's head comes in, its own difference goes out, then the
    // answer's payload is read and judged.
    let mut incoming = Incoming::new(&answer)?;
    let started = Instant::now();
    let Turn {
        send, mut gauge, ..
    } = initiator.on_head(&incoming.head(), &mut lent);
    stages.difference_s += started.elapsed().as_secs_f64();
    let ours = send.first().context("the initiator sent no parameters")?;
    let started = Instant::now();
    let ours = frame(ours)?;
    stages.write_s = started.elapsed().as_secs_f64();
    drop(send);
    // The gap of what comes in is taken as it is read, as a node's engine does.
    let started = Instant::now();
    let values = incoming.payload_watched(Gauge::watch(&mut gauge, lent.copies.as_deref()))?;
    if let Some(gap) = gauge.and_then(Gauge::finish) {
        initiator.on_gap(gap);
    }
    stages.read_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let turn = initiator.on_payload(values, &mut lent);
    stages.judge_s = started.elapsed().as_secs_f64();
    let end = match turn.end {
        Some(Ok(mixed)) => mixed.end,
        other => bail!("the initiator did not mix: {other:?}"),
    };
    let started = Instant::now();
    land(&mut a.replica, end, compressed.then_some(&a.copies));
    stages.mix_s = started.elapsed().as_secs_f64();

    // The responder: the initiator's parameters, then the stream's end.
    let mut incoming = Incoming::new(&ours)?;
    let mut lent = Lent::copies(compressed.then_some(&mut b.copies));
    let turn = responder.on_head(&incoming.head(), &mut lent);
    if turn.end.is_some() {
        bail!("the responder refused the initiator's parameters");
    }
    drop(turn);
    let _ = responder.on_payload(incoming.payload()?, &mut lent);
    match responder.on_end(&mut lent) {
        Ok(mixed) => land(&mut b.replica, mixed.end, compressed.then_some(&b.copies)),
        Err(outcome) => bail!("the responder did not mix: {outcome:?}"),
    }
    Ok((stages, ours.len() as u64))
}

/// A machine's frame as the wire writes it.
fn frame(frame: &(Head, Payload<'_>)) -> Result<Vec<u8>> {
    let mut out = Cursor::new(Vec::new());
    block_on(write(&mut out, frame, MODEL))?;
    Ok(out.into_inner())
}

/// Writes a machine's frame to `out` as the node's engine does, for a model of fingerprint
/// `model`; returns its bytes.
async fn write<W: AsyncWrite + Unpin>(
    out: &mut W,
    (head, payload): &(Head, Payload<'_>),
    model: &str,
) -> Result<u64, WireError> {
    let header = head.wire_header(*payload, RUN, model);
    match *payload {
        Payload::Values(values) => wire::write_frame(out, &header, values).await,
        Payload::Encoded { bytes, .. } => wire::write_encoded(out, &header, bytes).await,
        Payload::Empty => wire::write_encoded(out, &header, &[]).await,
    }
}

/// A frame coming in, read as the wire reads it: its header first, checked, then its
/// payload, decoded.
struct Incoming<'a> {
    reader: Cursor<&'a [u8]>,
    header: TensorHeader,
}

impl<'a> Incoming<'a> {
    fn new(bytes: &'a [u8]) -> Result<Self> {
        let mut reader = Cursor::new(bytes);
        let expect = Expect {
            run_id: RUN,
            fingerprint: MODEL,
            max_payload_bytes: u64::MAX,
        };
        let header = block_on(wire::read_header(&mut reader, &expect))?;
        Ok(Incoming { reader, header })
    }

    fn head(&self) -> Head {
        Head::from(&self.header)
    }

    fn payload(&mut self) -> Result<Vec<f32>> {
        self.payload_watched(|_, _| {})
    }

    /// [`Incoming::payload`], `watch` seeing each piece as it is decoded.
    fn payload_watched(&mut self, watch: impl FnMut(usize, &[f32])) -> Result<Vec<f32>> {
        let mut values = Vec::new();
        block_on(wire::read_payload_watched(
            &mut self.reader,
            &self.header,
            &mut values,
            watch,
        ))?;
        Ok(values)
    }
}

/// What the replica does with an exchange's end: `x += weight delta`.
/// Lands `end` on `replica` as a node's replica does: a compressed exchange's step read off the
/// pair's `copies` as they are now and added a run at a time (decisions 0092, 0094).
fn land(replica: &mut [f32], end: ExchangeEnd, copies: Option<&Copies>) {
    let ExchangeEnd::Mix { delta, weight } = end else {
        return;
    };
    match (delta, copies) {
        (Delta::Values(mut delta), _) => {
            mix::scale(&mut delta, weight);
            mix::add(replica, &delta);
        }
        (Delta::Step { step, .. }, Some(copies)) => step.runs(copies, weight, |at, run| {
            mix::add(&mut replica[at..at + run.len()], run);
        }),
        (Delta::Step { .. }, None) => {}
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn print(f: &Figures) {
    let s = &f.stages;
    println!(
        "{} parameters ({}), {}: frame {}; one side {:.3} s = difference {:.3} + write {:.3} + \
         read {:.3} + judge {:.3} + mix {:.3}; memory above the replicas and copies {}",
        f.params,
        report::bytes(f.model_bytes),
        f.codec,
        report::bytes(f.frame_bytes),
        f.side_s,
        s.difference_s,
        s.write_s,
        s.read_s,
        s.judge_s,
        s.mix_s,
        f.peak_extra_bytes
            .map_or("unknown (no counting allocator)".into(), |b| format!(
                "{} ({:.2}x the model a side)",
                report::bytes(b),
                f.peak_extra_per_side_models.unwrap_or(0.0)
            )),
    );
}
