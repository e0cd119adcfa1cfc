//! A flood of relay requests for the NAT testbed (`testnet/relay-flood.sh`): many identities,
//! each a minimal libp2p node with only a relay client, ask one relay for reservations and for
//! circuits to each other, over and over, holding what they get. The relay must keep to its
//! limits and keep serving its own run. Not part of `nodectl`.
//!
//! Prints one JSON line every ten seconds and at the end: requests made, accepted and refused
//! (circuits that failed were refused by the relay or by the identity at the far end: the
//! relay's own `/metrics` tell which).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt as _;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, noise, relay, tcp, yamux};
use tokio::sync::watch;

#[derive(Debug, Parser)]
#[command(
    about = "Floods a Murmur relay with reservation and circuit requests (not part of nodectl)"
)]
struct Args {
    /// The relay, as `/ip4/.../tcp/.../p2p/<peer id>`.
    #[arg(long)]
    relay: Multiaddr,
    /// Identities that flood at once.
    #[arg(long, default_value_t = 256)]
    identities: usize,
    /// How long to flood, in seconds.
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// Pause between one identity's requests, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pause_ms: u64,
}

/// Requests made and how the relay answered, summed over every identity.
#[derive(Debug, Default)]
struct Tally {
    reservations: AtomicU64,
    reservations_accepted: AtomicU64,
    reservations_refused: AtomicU64,
    circuits: AtomicU64,
    circuits_accepted: AtomicU64,
    circuits_failed: AtomicU64,
}

impl Tally {
    fn add(cell: &AtomicU64) {
        cell.fetch_add(1, Ordering::Relaxed);
    }

    fn print(&self, elapsed: Duration, last: bool) {
        let get = |cell: &AtomicU64| cell.load(Ordering::Relaxed);
        println!(
            "{}",
            serde_json::json!({
                "elapsed_s": elapsed.as_secs(),
                "done": last,
                "reservations": get(&self.reservations),
                "reservations_accepted": get(&self.reservations_accepted),
                "reservations_refused": get(&self.reservations_refused),
                "circuits": get(&self.circuits),
                "circuits_accepted": get(&self.circuits_accepted),
                "circuits_failed": get(&self.circuits_failed),
            })
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(Protocol::P2p(relay)) = args.relay.iter().last() else {
        bail!("--relay must end in /p2p/<the relay's peer id>");
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start a runtime")?;
    runtime.block_on(run(args, relay))
}

async fn run(args: Args, relay: PeerId) -> Result<()> {
    let tally = Arc::new(Tally::default());
    // Each identity publishes its relayed address once it holds a reservation, and dials
    // circuits to the others' (or to the relay's other clients, when none holds one).
    let (reserved_tx, reserved) = watch::channel(Vec::<Multiaddr>::new());
    let reserved_tx = Arc::new(reserved_tx);
    let started = Instant::now();
    let end = started + Duration::from_secs(args.duration);
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..args.identities {
        let (args_relay, pause) = (args.relay.clone(), Duration::from_millis(args.pause_ms));
        let (tally, reserved, reserved_tx) = (
            Arc::clone(&tally),
            reserved.clone(),
            Arc::clone(&reserved_tx),
        );
        tasks.spawn(async move {
            if let Err(e) = flood(
                index,
                args_relay,
                relay,
                pause,
                end,
                &tally,
                reserved,
                &reserved_tx,
            )
            .await
            {
                eprintln!("identity {index}: {e:#}");
            }
        });
    }
    let mut report = tokio::time::interval(Duration::from_secs(10));
    report.tick().await;
    loop {
        tokio::select! {
            _ = report.tick() => tally.print(started.elapsed(), false),
            next = tasks.join_next() => if next.is_none() { break },
        }
    }
    tally.print(started.elapsed(), true);
    Ok(())
}

/// One identity's flood until `end`: it asks for a reservation whenever it holds none, and
/// dials a circuit through the relay to another identity's relayed address every `pause`,
/// keeping what it is granted.
#[allow(clippy::too_many_arguments)]
async fn flood(
    index: usize,
    relay_addr: Multiaddr,
    relay: PeerId,
    pause: Duration,
    end: Instant,
    tally: &Tally,
    reserved: watch::Receiver<Vec<Multiaddr>>,
    reserved_tx: &watch::Sender<Vec<Multiaddr>>,
) -> Result<()> {
    let mut swarm = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )?
        .with_relay_client(noise::Config::new, yamux::Config::default)?
        .with_behaviour(|_, client| client)?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(300)))
        .build();
    let circuit = relay_addr.clone().with(Protocol::P2pCircuit);
    swarm.dial(relay_addr).context("cannot dial the relay")?;
    // A reservation asked for, and whether the relay granted it.
    let (mut listening, mut held) = (false, false);
    let mut tick = tokio::time::interval(pause);
    // Identities start at different moments within the first pause.
    tokio::time::sleep(pause.mul_f64(index as f64 / 256.0 % 1.0)).await;
    while Instant::now() < end {
        tokio::select! {
            _ = tick.tick() => {
                if !listening {
                    listening = true;
                    Tally::add(&tally.reservations);
                    if swarm.listen_on(circuit.clone()).is_err() {
                        listening = false;
                        Tally::add(&tally.reservations_refused);
                    }
                }
                let targets = reserved.borrow().clone();
                if !targets.is_empty() {
                    let target = targets[(index + tally.circuits.load(Ordering::Relaxed) as usize) % targets.len()].clone();
                    if target.iter().last() != Some(Protocol::P2p(*swarm.local_peer_id())) {
                        Tally::add(&tally.circuits);
                        if swarm.dial(target).is_err() {
                            Tally::add(&tally.circuits_failed);
                        }
                    }
                }
            }
            event = swarm.select_next_some() => match event {
                SwarmEvent::Behaviour(relay::client::Event::ReservationReqAccepted { renewal: false, .. }) => {
                    held = true;
                    Tally::add(&tally.reservations_accepted);
                    let mine = circuit.clone().with(Protocol::P2p(*swarm.local_peer_id()));
                    reserved_tx.send_modify(|all| if all.len() < 1024 { all.push(mine) });
                }
                SwarmEvent::ListenerClosed { .. } | SwarmEvent::ListenerError { .. } => {
                    if listening && !held {
                        Tally::add(&tally.reservations_refused);
                    }
                    (listening, held) = (false, false);
                }
                SwarmEvent::ConnectionEstablished { endpoint, .. } if endpoint.is_relayed() && endpoint.is_dialer() => {
                    Tally::add(&tally.circuits_accepted);
                }
                SwarmEvent::OutgoingConnectionError { peer_id, .. } if peer_id != Some(relay) => {
                    Tally::add(&tally.circuits_failed);
                }
                _ => {}
            },
        }
    }
    Ok(())
}
