//! `nodectl bench exchange --transport tcp|quic`: the same exchange between two processes, as
//! two nodes run it: each side holds its own replica and the pair's copies, its frames go over
//! a libp2p stream of `/murmur/params/3`, and it writes its difference while the partner's
//! comes in (decision 0027), as the engine's pump does. The responder is a second process on
//! loopback that the initiator starts, or one started by hand with `--serve` on another
//! machine (`--partner`: the exchange over a real link). The initiator (this process) times
//! each exchange from the snapshot to the mix landed, and, on the same connection just before
//! it, a plain frame of as many bytes sent and acknowledged: the link's time for the
//! exchange's bytes, measured in the same sitting. Each side counts the memory it held above
//! its replica and its copies with its own allocator count.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::codec::Codec;
use murmur_protocol::network::{Client, Incoming, Multiaddr, PeerId, Stream, StreamProtocol};
use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader, WireError};
use murmur_sync::copies::{Copies, Gauge};
use murmur_sync::machines::pairwise::{Initiator, Responder};
use murmur_sync::machines::{Head, Lent, Machine, Payload};
use murmur_sync::replica::Snapshot;
use murmur_sync::screen::Screen;
use murmur_sync::settings::SyncSettings;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use serde_json::json;

use super::{RUN, Side, land, median, write};
use crate::allocator;
use crate::cli::BenchExchangeArgs;
use crate::commands::transfer::{
    Receiver, address_of, listen, node, peer_of, runtime, until_closed,
};
use crate::report::{self, round};

/// The longest an exchange or a plain frame may take before the bench gives up on the partner.
const PATIENCE: Duration = Duration::from_secs(600);

/// The fingerprint the two sides' frames carry for one size: a responder started with other
/// `--params`, `--codec` or `--rounds` than the initiator refuses its first frame by name
/// instead of answering an exchange it cannot mix.
fn model(args: &BenchExchangeArgs, params: usize) -> String {
    format!("bench-{params}-{}-{}", args.codec, args.rounds)
}

/// Where the initiator's exchange spends its time, in the order it comes.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Stages {
    /// The replica's snapshot taken.
    snapshot_s: f64,
    /// Our difference against the pair's copies, encoded, made once the offer went out
    /// (`Machine::work_ahead`; a dense exchange: none).
    ahead_s: f64,
    /// The rest of the wait for the answer's head (the responder's snapshot and difference).
    answer_s: f64,
    /// Our frame written while the answer's payload is read (and decoded).
    transfer_s: f64,
    /// The answer judged, the copies committed.
    judge_s: f64,
    /// The mix landed on the replica.
    mix_s: f64,
}

/// One model size's figures through the network.
#[derive(Debug, Serialize)]
struct Figures {
    bench: &'static str,
    transport: String,
    /// The responder's address where it was started by hand (`--partner`); `None`: a second
    /// process on loopback.
    partner: Option<String>,
    params: usize,
    codec: String,
    model_bytes: u64,
    /// Bytes of the initiator's frames (its parameters' header and payload).
    frame_bytes: u64,
    /// The initiator's exchange, from its snapshot to the mix landed on its replica.
    exchange_s: f64,
    /// A plain frame of `frame_bytes` on the same connection, sent and acknowledged.
    link_s: f64,
    /// `exchange_s / link_s`: what the exchange costs beyond its bytes on the link.
    exchange_over_link: f64,
    /// The initiator's exchange stage by stage (each the median).
    stages: Stages,
    /// Medians over this many exchanges (and as many frames), after one that warms the copies.
    rounds: usize,
    /// Each side's most memory held during an exchange above its replica and its copies, as a
    /// multiple of the model's bytes (by nodectl's allocator count, `None` without it; a
    /// partner started by hand prints its own).
    initiator_peak_extra_models: Option<f64>,
    responder_peak_extra_models: Option<f64>,
    /// The pair's copies each side holds, as a multiple of the model's bytes: added to a
    /// side's figure above, its memory above the replica alone.
    copies_models: f64,
}

/// The initiator's side: starts the responder's process, then alternates a plain frame and an
/// exchange, `rounds` times, after one exchange that warms the copies.
pub(super) fn run(
    args: &BenchExchangeArgs,
    transport: &str,
    settings: &SyncSettings,
    params: usize,
) -> Result<()> {
    let runtime = runtime()?;
    let figures = runtime.block_on(initiate(args, transport, settings, params))?;
    if args.json {
        println!("{}", serde_json::to_string(&figures)?);
    } else {
        let extra = |peak: Option<f64>| {
            peak.map_or("printed by the partner".into(), |p| format!("{p:.2}x"))
        };
        println!(
            "{} parameters ({}), {} over {}: frame {}; exchange {:.3} s, the same bytes on the \
             link {:.3} s ({:.2}x); memory above replica and copies: initiator {}, responder {} \
             (copies {:.2}x)",
            figures.params,
            report::bytes(figures.model_bytes),
            figures.codec,
            figures.transport,
            report::bytes(figures.frame_bytes),
            figures.exchange_s,
            figures.link_s,
            figures.exchange_over_link,
            extra(figures.initiator_peak_extra_models),
            extra(figures.responder_peak_extra_models),
            figures.copies_models,
        );
    }
    Ok(())
}

async fn initiate(
    args: &BenchExchangeArgs,
    transport: &str,
    settings: &SyncSettings,
    params: usize,
) -> Result<Figures> {
    let (receiver, addr) = match &args.partner {
        Some(addr) => (None, address_of(transport, addr, "--partner")?),
        None => {
            let receiver = Receiver::start(&[
                "--log",
                "error",
                "bench",
                "exchange",
                "--serve",
                "--transport",
                transport,
                "--params",
                &params.to_string(),
                "--codec",
                &args.codec,
                "--rounds",
                &args.rounds.to_string(),
                "--seed",
                &args.seed.to_string(),
            ])?;
            let addr = receiver.addr.clone();
            (Some(receiver), addr)
        }
    };
    let peer = peer_of(&addr)?;
    let (client, _events, event_loop) = node(Vec::new())?;
    tokio::spawn(event_loop.run(std::future::pending()));
    client
        .dial(addr.clone())
        .await
        .with_context(|| format!("cannot reach the responder at {addr}"))?;
    let model = model(args, params);
    let hint = match args.partner {
        Some(_) => {
            " (is the partner serving the same --params, --codec and --rounds? its output says)"
        }
        None => "",
    };

    let mut side = side(params, args.seed, Role::Initiator);
    let mut peak_extra: Option<u64> = None;
    let mut exchanges = Vec::with_capacity(args.rounds);
    let mut stages = Vec::with_capacity(args.rounds);
    let mut links = Vec::with_capacity(args.rounds);
    let mut frame_bytes = 0;
    for round in 0..=args.rounds {
        if round > 0 {
            // A frame of one value first: its answer comes once the responder is done with
            // the exchange before, so that the link's time is the bytes' alone.
            let what = format!("a plain frame before exchange {round}{hint}");
            patiently(&what, link(&client, peer, &model, 4)).await?;
            links.push(patiently(&what, link(&client, peer, &model, frame_bytes)).await?);
        }
        let before = allocator::held_bytes();
        allocator::reset_peak();
        let started = Instant::now();
        let exchange = offer(&client, peer, settings, &model, &mut side, round as u64);
        let (bytes, timed, mut stream) =
            patiently(&format!("exchange {round}{hint}"), exchange).await?;
        let took = started.elapsed().as_secs_f64();
        // Our frame is the responder's only once it closed its side too: until then it may
        // still be on its way, and the connection (which the next size's node replaces) must
        // not go before it arrives.
        let closed = until_closed(&mut stream);
        patiently(
            &format!("the responder's end of exchange {round}{hint}"),
            closed,
        )
        .await?;
        frame_bytes = bytes;
        if round > 0 {
            exchanges.push(took);
            stages.push(timed);
        }
        peak_extra = most(peak_extra, before, allocator::peak_bytes());
    }
    let responder_peak = match receiver {
        Some(receiver) => receiver.finish()?["peak_extra_bytes"].as_u64(),
        None => None,
    };
    let model_bytes = (params * std::mem::size_of::<f32>()) as u64;
    let models = |bytes: u64| round(bytes as f64 / model_bytes as f64, 2);
    let (exchange_s, link_s) = (median(exchanges), median(links));
    let compressed = settings.codec != Codec::F32;
    Ok(Figures {
        bench: "exchange",
        transport: transport.to_owned(),
        partner: args.partner.clone(),
        params,
        codec: args.codec.clone(),
        model_bytes,
        frame_bytes,
        exchange_s: round(exchange_s, 4),
        link_s: round(link_s, 4),
        exchange_over_link: round(exchange_s / link_s, 2),
        stages: Stages::median(&stages),
        rounds: args.rounds,
        initiator_peak_extra_models: peak_extra.map(models),
        responder_peak_extra_models: responder_peak.map(models),
        copies_models: if compressed {
            models(Copies::bytes_for(params))
        } else {
            0.0
        },
    })
}

/// `work`, its error named by `what`, given up after [`PATIENCE`].
async fn patiently<T>(what: &str, work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(PATIENCE, work)
        .await
        .map_err(|_| anyhow!("{what} took over {} s", PATIENCE.as_secs()))?
        .context(what.to_owned())
}

/// Which side a process plays; each draws its replica from its own stream of the seed.
#[derive(Clone, Copy)]
enum Role {
    Initiator,
    Responder,
}

fn side(params: usize, seed: u64, role: Role) -> Side {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(2).wrapping_add(role as u64));
    Side {
        replica: (0..params).map(|_| rng.random_range(-0.1..0.1)).collect(),
        copies: Copies::fresh(params),
    }
}

/// The larger of `peak` and what the allocator's peak holds above `before`.
fn most(peak: Option<u64>, before: Option<u64>, now: Option<u64>) -> Option<u64> {
    let extra = now?.saturating_sub(before?);
    Some(peak.map_or(extra, |p| p.max(extra)))
}

/// One exchange offered to `peer` as a node offers it: the snapshot, the stream, the
/// [`Initiator`] driven to its end, the mix landed. Returns the bytes of our frames, the
/// stages, and the stream, closed on our side.
async fn offer(
    client: &Client,
    peer: PeerId,
    settings: &SyncSettings,
    model: &str,
    side: &mut Side,
    step: u64,
) -> Result<(u64, Stages, Stream)> {
    let mut clock = Clock::start();
    let snapshot = Arc::new(Snapshot {
        step,
        params: side.replica.clone(),
    });
    let mut stages = Stages {
        snapshot_s: clock.lap(),
        ..Stages::default()
    };
    let compressed = settings.codec != Codec::F32;
    let mut machine = Initiator::new(
        settings,
        snapshot,
        settings.codec,
        0.5,
        Screen::default(),
        compressed.then_some(&side.copies),
    );
    let mut stream = open(client, peer).await?;
    let mut sent = 0;
    let mixed = drive(
        &mut stream,
        model,
        &mut machine,
        Opening::Asks,
        compressed.then_some(&mut side.copies),
        &mut sent,
        Some((&mut clock, &mut stages)),
    )
    .await?;
    let _ = stream.close().await;
    land(
        &mut side.replica,
        mixed.end,
        compressed.then_some(&side.copies),
    );
    stages.mix_s = clock.lap();
    Ok((sent, stages, stream))
}

/// Laps of one exchange.
struct Clock(Instant);

impl Clock {
    fn start() -> Self {
        Clock(Instant::now())
    }

    /// Seconds since the last lap.
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let lap = (now - self.0).as_secs_f64();
        self.0 = now;
        lap
    }
}

impl Stages {
    fn median(rounds: &[Stages]) -> Stages {
        let of = |f: fn(&Stages) -> f64| round(median(rounds.iter().map(f).collect()), 4);
        Stages {
            snapshot_s: of(|s| s.snapshot_s),
            ahead_s: of(|s| s.ahead_s),
            answer_s: of(|s| s.answer_s),
            transfer_s: of(|s| s.transfer_s),
            judge_s: of(|s| s.judge_s),
            mix_s: of(|s| s.mix_s),
        }
    }
}

/// A plain frame of about `bytes` to `peer`, until its acknowledgement: the link's time for
/// them.
async fn link(client: &Client, peer: PeerId, model: &str, bytes: u64) -> Result<f64> {
    let values = vec![0.5f32; bytes as usize / std::mem::size_of::<f32>()];
    let header = TensorHeader::for_payload(MessageKind::Params, RUN, model, 0, &values);
    let started = Instant::now();
    let mut stream = open(client, peer).await?;
    wire::write_frame(&mut stream, &header, &values).await?;
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).await?;
    let took = started.elapsed().as_secs_f64();
    let _ = stream.close().await;
    Ok(took)
}

async fn open(client: &Client, peer: PeerId) -> Result<Stream> {
    client
        .open_stream(peer, StreamProtocol::new(PARAMS_PROTOCOL))
        .await
        .map_err(|e| anyhow!("cannot open a stream to the responder: {e}"))
}

/// How a side's part of the stream begins.
enum Opening {
    /// It writes its request, then works ahead while the answer is made.
    Asks,
    /// It writes its answer while the other side's next frame comes in whole (the other side
    /// writes it once it has read our head).
    Answers,
}

/// Runs one side's `machine` over `stream` to its end, as the node's engine does
/// (`ExchangeContext::pump`): its opening, then each frame's head, what the machine writes on
/// it going out while the payload comes in. `sent`: the bytes of our frames; `timed`: where
/// the time went (a side that asks, with one answer).
async fn drive<M: Machine>(
    stream: &mut Stream,
    model: &str,
    machine: &mut M,
    opening: Opening,
    mut copies: Option<&mut Copies>,
    sent: &mut u64,
    mut timed: Option<(&mut Clock, &mut Stages)>,
) -> Result<M::Done> {
    let mut lap = |stage: fn(&mut Stages) -> &mut f64| {
        if let Some((clock, stages)) = timed.as_mut() {
            *stage(stages) += clock.lap();
        }
    };
    let expect = expect(model);
    let mut first = match opening {
        Opening::Asks => {
            send_all(stream, model, machine.start(), sent).await?;
            machine.work_ahead(&mut Lent::copies(copies.as_deref_mut()));
            lap(|s| &mut s.ahead_s);
            None
        }
        Opening::Answers => {
            let (mut reader, mut writer) = (&mut *stream).split();
            let mut values = Vec::new();
            let (wrote, read) = futures::join!(
                send_all(&mut writer, model, machine.start(), sent),
                wire::read_frame(&mut reader, &expect, &mut values),
            );
            wrote?;
            Some((read?, values))
        }
    };
    let mut received = Vec::new();
    let done = loop {
        let (header, read) = match first.take() {
            Some((header, values)) => (header, Some(values)),
            None => match wire::read_header(stream, &expect).await {
                Ok(header) => (header, None),
                Err(WireError::Empty) => {
                    break machine.on_end(&mut Lent::copies(copies.as_deref_mut()));
                }
                Err(e) => return Err(e.into()),
            },
        };
        lap(|s| &mut s.answer_s);
        let mut lent = Lent::copies(copies.as_deref_mut());
        let turn = machine.on_head(&Head::from(&header), &mut lent);
        if let Some(end) = turn.end {
            send_all(stream, model, turn.send, sent).await?;
            break end;
        }
        let values = match read {
            Some(values) => {
                send_all(stream, model, turn.send, sent).await?;
                values
            }
            None => {
                // A compressed exchange takes the gap of what comes in as it comes.
                let mut gauge = turn.gauge;
                let watch = Gauge::watch(&mut gauge, lent.copies.as_deref());
                let (mut reader, mut writer) = (&mut *stream).split();
                let (wrote, read) = futures::join!(
                    send_all(&mut writer, model, turn.send, sent),
                    wire::read_payload_watched(&mut reader, &header, &mut received, watch),
                );
                wrote?;
                read?;
                if let Some(gap) = gauge.and_then(Gauge::finish) {
                    machine.on_gap(gap);
                }
                std::mem::take(&mut received)
            }
        };
        lap(|s| &mut s.transfer_s);
        let turn = machine.on_payload(values, &mut lent);
        let end = turn.end;
        send_all(stream, model, turn.send, sent).await?;
        lap(|s| &mut s.judge_s);
        if let Some(end) = end {
            break end;
        }
    };
    done.map_err(|outcome| anyhow!("the exchange did not mix: {outcome:?}"))
}

async fn send_all<W: futures::AsyncWrite + Unpin>(
    out: &mut W,
    model: &str,
    frames: Vec<(Head, Payload<'_>)>,
    sent: &mut u64,
) -> Result<(), WireError> {
    for frame in frames {
        *sent += write(out, &frame, model).await?;
    }
    Ok(())
}

fn expect(model: &str) -> Expect<'_> {
    Expect {
        run_id: RUN,
        fingerprint: model,
        max_payload_bytes: u64::MAX,
    }
}

/// The responder's process: prints its address, then for each size of `--params` answers the
/// initiator's streams (each exchange as a node answers an offer, each plain frame with one
/// byte) and prints the most memory an exchange held above its replica and copies.
pub(super) fn serve(
    args: &BenchExchangeArgs,
    settings: &SyncSettings,
    addr: Multiaddr,
) -> Result<()> {
    runtime()?.block_on(async {
        let (_client, mut incoming) = listen(addr).await?;
        for &params in &args.params {
            let peak = answer(&mut incoming, args, settings, params)
                .await
                .with_context(|| {
                    format!(
                        "answering the exchanges of {params} parameters (start both sides with \
                         the same --params, --codec and --rounds)"
                    )
                })?;
            let model_bytes = (params * std::mem::size_of::<f32>()) as f64;
            println!(
                "{}",
                json!({
                    "params": params,
                    "peak_extra_bytes": peak,
                    "peak_extra_models": peak.map(|p| round(p as f64 / model_bytes, 2)),
                })
            );
            std::io::Write::flush(&mut std::io::stdout())?;
        }
        Ok(())
    })
}

/// Answers one size's exchanges: one that warms the copies, then two plain frames (one
/// value, then the exchange's bytes) and an exchange a round. Returns the most memory an
/// exchange held above the replica and copies.
async fn answer(
    incoming: &mut Incoming,
    args: &BenchExchangeArgs,
    settings: &SyncSettings,
    params: usize,
) -> Result<Option<u64>> {
    let mut side = side(params, args.seed, Role::Responder);
    let compressed = settings.codec != Codec::F32;
    let model = model(args, params);
    let expect = expect(&model);
    let mut peak_extra = None;
    let mut payload = Vec::new();
    for _ in 0..1 + 3 * args.rounds {
        let (_, mut stream) = incoming.next().await.context("the initiator went away")?;
        let header = wire::read_frame(&mut stream, &expect, &mut payload).await?;
        if header.kind != MessageKind::Offer {
            stream.write_all(&[1]).await?;
            let _ = stream.close().await;
            until_closed(&mut stream).await?;
            continue;
        }
        let before = allocator::held_bytes();
        allocator::reset_peak();
        let snapshot = Arc::new(Snapshot {
            step: header.step,
            params: side.replica.clone(),
        });
        let mut machine = Responder::new(
            settings,
            &Head::from(&header),
            snapshot,
            0.5,
            Screen::default(),
            compressed.then_some(&mut side.copies),
        );
        let copies = compressed.then_some(&mut side.copies);
        let mut sent = 0;
        let opening = Opening::Answers;
        let mixed = drive(
            &mut stream,
            &model,
            &mut machine,
            opening,
            copies,
            &mut sent,
            None,
        )
        .await?;
        land(
            &mut side.replica,
            mixed.end,
            compressed.then_some(&side.copies),
        );
        peak_extra = most(peak_extra, before, allocator::peak_bytes());
        let _ = stream.close().await;
        until_closed(&mut stream).await?;
    }
    Ok(peak_extra)
}
