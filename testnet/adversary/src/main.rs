//! A hostile peer for the testnet (`testnet/soak.sh`): it joins a run by its id and model
//! fingerprint and, against every peer it meets, plays the behaviours of issue 20 in turn:
//! heartbeats claiming step 0, exchanges answered with steered parameters, streams opened and
//! left silent, state requests, and garbage frames. It never trains. Not part of `nodectl`:
//! the hostile-peer suite (`daemon/tests/hostile.rs`) plays the same behaviours one by one.
//!
//! Prints one JSON line a minute and at the end with what it did and how peers answered.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use futures::{AsyncReadExt as _, AsyncWriteExt as _};
use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role, SyncMode, unix_ms_now};
use murmur_protocol::network::{
    self, Client, Keypair, Multiaddr, NetworkConfig, PeerId, StreamProtocol,
};
use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader};
use murmur_protocol::{PARAMS_PROTOCOL, STATE_PROTOCOL};
use rand::RngExt as _;

#[derive(Debug, Parser)]
#[command(about = "A hostile peer for the Murmur testnet (not part of nodectl)")]
struct Args {
    /// The run to join (`run_id` in `nodectl status --json`).
    #[arg(long)]
    run_id: String,
    /// The model fingerprint of the run (`fingerprint` in `nodectl status --json`).
    #[arg(long)]
    fingerprint: String,
    /// Addresses of peers to dial (repeatable).
    #[arg(long, required = true)]
    bootstrap: Vec<Multiaddr>,
    /// How long to misbehave, in seconds.
    #[arg(long, default_value_t = 600)]
    duration: u64,
}

/// What the adversary did, and what came of it.
#[derive(Debug, Default)]
struct Tally(BTreeMap<&'static str, u64>);

impl Tally {
    fn count(&mut self, what: &'static str) {
        *self.0.entry(what).or_default() += 1;
    }

    fn print(&self, elapsed: Duration) {
        let mut line = serde_json::Map::new();
        line.insert("elapsed_s".into(), elapsed.as_secs().into());
        for (what, n) in &self.0 {
            line.insert((*what).into(), (*n).into());
        }
        println!("{}", serde_json::Value::Object(line));
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Runtime::new().context("cannot start a runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> Result<()> {
    let mut config =
        NetworkConfig::new(Keypair::generate_ed25519(), &args.run_id, &args.fingerprint);
    config.mdns = false;
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    config.bootstrap = args.bootstrap.clone();
    let (client, _events, event_loop) = network::new(config)?;
    tokio::spawn(event_loop.run(std::future::pending()));
    for address in &args.bootstrap {
        let _ = client.dial(address.clone()).await;
    }
    let start = Instant::now();
    let end = start + Duration::from_secs(args.duration);
    let mut tally = Tally::default();
    let mut held = Vec::new();
    let mut round = 0u64;
    let mut last_print = start;
    while Instant::now() < end {
        round += 1;
        // A lying clock, every round.
        let lie = Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: args.run_id.clone(),
            fingerprint: args.fingerprint.clone(),
            step: 0,
            epoch: 0,
            loss_ema: 1.0,
            samples_seen: 0,
            mode: SyncMode::Gossip,
            role: Role::Worker,
            leaving: false,
            finished: false,
            client: false,
            sent_ms: unix_ms_now(),
        };
        if client.publish_heartbeat(&lie).await.is_ok() {
            tally.count("lying_heartbeats");
        }
        let peers = client.connected_peers().await.unwrap_or_default();
        if !peers.is_empty() {
            let peer = peers[rand::rng().random_range(0..peers.len())];
            let outcome = tokio::time::timeout(
                Duration::from_secs(10),
                misbehave(&client, &args, peer, round, &mut held),
            )
            .await
            .unwrap_or("timed_out");
            tally.count(outcome);
        }
        // Held streams are let go after a while, as a slow peer's would be.
        if held.len() > 8 {
            held.drain(..4);
        }
        if last_print.elapsed() >= Duration::from_secs(60) {
            tally.print(start.elapsed());
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tally.print(start.elapsed());
    Ok(())
}

/// One behaviour against `peer`, chosen by `round`; says what came of it.
async fn misbehave(
    client: &Client,
    args: &Args,
    peer: PeerId,
    round: u64,
    held: &mut Vec<network::Stream>,
) -> &'static str {
    let params = || StreamProtocol::new(PARAMS_PROTOCOL);
    match round % 4 {
        // Poisoning: offer an exchange, answer with the peer's own replica steered along a
        // fixed direction by 4 % of its norm.
        0 => {
            let Ok(mut stream) = client.open_stream(peer, params()).await else {
                return "no_stream";
            };
            let expect = Expect {
                run_id: &args.run_id,
                fingerprint: &args.fingerprint,
                max_payload_bytes: 1 << 30,
            };
            let offer = TensorHeader::for_payload(
                MessageKind::Offer,
                &args.run_id,
                &args.fingerprint,
                0,
                &[],
            );
            if wire::write_frame(&mut stream, &offer, &[]).await.is_err() {
                return "offer_refused";
            }
            let mut theirs = Vec::new();
            let Ok(header) = wire::read_frame(&mut stream, &expect, &mut theirs).await else {
                return "offer_refused";
            };
            if header.kind != MessageKind::Params {
                return "offer_busy";
            }
            let norm = theirs.iter().map(|v| v * v).sum::<f32>().sqrt();
            let scale = 0.04 * norm / (theirs.len() as f32 / 2.0).sqrt();
            let steered: Vec<f32> = theirs
                .iter()
                .enumerate()
                .map(|(i, v)| v + scale * (i as f32 * 12.9898).sin())
                .collect();
            let answer = TensorHeader::for_payload(
                MessageKind::Params,
                &args.run_id,
                &args.fingerprint,
                header.step,
                &steered,
            );
            if wire::write_frame(&mut stream, &answer, &steered)
                .await
                .is_err()
            {
                return "poison_refused";
            }
            let _ = stream.close().await;
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
            if rest.is_empty() {
                "poison_taken"
            } else {
                "poison_refused"
            }
        }
        // Exhaustion: streams that send one byte and then nothing.
        1 => {
            for _ in 0..3 {
                let Ok(mut stream) = client.open_stream(peer, params()).await else {
                    return "no_stream";
                };
                let _ = stream.write_all(&[1]).await;
                let _ = stream.flush().await;
                held.push(stream);
            }
            "streams_held"
        }
        // Amplification: ask for the whole state.
        2 => {
            let Ok(mut stream) = client
                .open_stream(peer, StreamProtocol::new(STATE_PROTOCOL))
                .await
            else {
                return "no_stream";
            };
            let request = TensorHeader::for_payload(
                MessageKind::State,
                &args.run_id,
                &args.fingerprint,
                0,
                &[],
            );
            let expect = Expect {
                run_id: &args.run_id,
                fingerprint: &args.fingerprint,
                max_payload_bytes: 1 << 30,
            };
            if wire::write_frame(&mut stream, &request, &[]).await.is_err() {
                return "state_refused";
            }
            match wire::read_header(&mut stream, &expect).await {
                Ok(header) if header.kind == MessageKind::State => "state_answered",
                Ok(_) => "state_busy",
                Err(_) => "state_refused",
            }
        }
        // Garbage: a frame header that is not CBOR.
        _ => {
            let Ok(mut stream) = client.open_stream(peer, params()).await else {
                return "no_stream";
            };
            let mut garbage = vec![1u8, 0, 16, 0, 0, 0];
            garbage.extend((0..16).map(|_| rand::rng().random::<u8>()));
            let _ = stream.write_all(&garbage).await;
            let _ = stream.close().await;
            "garbage_sent"
        }
    }
}
