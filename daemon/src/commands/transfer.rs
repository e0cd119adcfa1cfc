//! `nodectl bench transfer`: a parameter buffer from this process to a second nodectl process
//! over `/murmur/params/3` on loopback, through the same network stack and frame codec as the
//! daemon. The receiver reads every frame into one reused buffer and acknowledges it with one
//! byte, so each timing covers the whole trip, checksum included.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::{AsyncRead, AsyncReadExt, AsyncWriteExt, StreamExt};
use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::network::{
    self, Incoming, Keypair, Multiaddr, NetworkConfig, NetworkEvent, PeerId, StreamProtocol,
};
use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader};
use serde_json::json;

use crate::cli::BenchTransferArgs;
use crate::report::{peak_rss_mb, round};

const RUN: &str = "bench";
const MODEL: &str = "bench";

/// A loopback address to listen on with `transport` (`tcp` or `quic`).
pub(super) fn listen_addr(transport: &str) -> Result<Multiaddr> {
    let text = match transport {
        "tcp" => "/ip4/127.0.0.1/tcp/0",
        "quic" => "/ip4/127.0.0.1/udp/0/quic-v1",
        other => bail!("--transport `{other}`: use `tcp` or `quic`"),
    };
    Ok(text.parse()?)
}

pub(super) type Node = (
    network::Client,
    tokio::sync::mpsc::Receiver<NetworkEvent>,
    network::EventLoop,
);

/// A bare network node of the benchmarks' run, without mDNS, listening on `listen`.
pub(super) fn node(listen: Vec<Multiaddr>) -> Result<Node> {
    let mut config = NetworkConfig::new(Keypair::generate_ed25519(), RUN, MODEL);
    config.mdns = false;
    config.listen = listen;
    Ok(network::new(config)?)
}

pub(super) fn run(args: &BenchTransferArgs) -> Result<()> {
    if args.size_mb == 0 || args.rounds == 0 {
        bail!("--size-mb and --rounds must be positive");
    }
    let runtime = runtime()?;
    if args.serve {
        runtime.block_on(serve(args))
    } else {
        runtime.block_on(send(args))
    }
}

/// The runtime of a benchmark's network node.
pub(super) fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// `addr` (given as `flag`) as a multiaddr of `transport`: a side that dials it or listens on
/// it speaks the transport its figures name.
pub(super) fn address_of(transport: &str, addr: &str, flag: &str) -> Result<Multiaddr> {
    let parsed: Multiaddr = addr.parse().with_context(|| {
        format!("{flag} `{addr}` is not a multiaddr (`/ip4/10.0.0.2/tcp/9100`)")
    })?;
    let speaks = parsed.iter().any(|p| match transport {
        "tcp" => matches!(p, libp2p::multiaddr::Protocol::Tcp(_)),
        _ => matches!(p, libp2p::multiaddr::Protocol::QuicV1),
    });
    if !speaks {
        let example = listen_addr(transport)?;
        bail!(
            "{flag} `{addr}` is not a {transport} address (`{example}`); give one of --transport {transport}"
        );
    }
    Ok(parsed)
}

/// The peer id at the end of `addr`, as a receiver prints its address.
pub(super) fn peer_of(addr: &Multiaddr) -> Result<PeerId> {
    addr.iter()
        .find_map(|p| match p {
            libp2p::multiaddr::Protocol::P2p(peer) => Some(peer),
            _ => None,
        })
        .with_context(|| format!("`{addr}` has no peer id: give the address the receiver printed, `/p2p/...` included"))
}

/// A receiving process's node: listens on `addr`, takes the streams of `/murmur/params/3`,
/// and prints its address for the process that started it ([`Receiver`]) or the person who
/// starts the sender. The client must live as long as the streams are read.
pub(super) async fn listen(addr: Multiaddr) -> Result<(network::Client, Incoming)> {
    let (client, mut events, event_loop) = node(vec![addr])?;
    tokio::spawn(event_loop.run(std::future::pending()));
    let incoming = client.accept(StreamProtocol::new(PARAMS_PROTOCOL))?;
    let Some(addr) = network::listen_address(&mut events).await else {
        bail!("the network stopped before it listened");
    };
    // Nothing else reads the events; let them go.
    drop(events);
    println!("{addr}");
    std::io::stdout().flush()?;
    Ok((client, incoming))
}

/// The receiving process: prints its address, receives `rounds` frames, prints its memory.
async fn serve(args: &BenchTransferArgs) -> Result<()> {
    let (_client, mut incoming) = listen(listen_addr(&args.transport)?).await?;
    let baseline = peak_rss_mb().unwrap_or(0.0);
    let expect = Expect {
        run_id: RUN,
        fingerprint: MODEL,
        max_payload_bytes: (args.size_mb as u64) << 20,
    };
    let mut buffer = Vec::new();
    for _ in 0..args.rounds {
        let (_, mut stream) = incoming.next().await.context("sender went away")?;
        wire::read_frame(&mut stream, &expect, &mut buffer).await?;
        stream.write_all(&[1]).await?;
        stream.close().await?;
        until_closed(&mut stream).await?;
    }
    println!(
        "{}",
        json!({"peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline})
    );
    Ok(())
}

/// Waits for the other side to close `stream`, which it does once it holds what this side sent
/// last. This keeps the process, and the connection, until that has left: a process that
/// exited after writing its last answer could take the connection down with the answer unsent.
pub(super) async fn until_closed(stream: &mut (impl AsyncRead + Unpin)) -> Result<()> {
    let mut rest = [0u8; 1];
    if stream.read(&mut rest).await? != 0 {
        bail!("the other side sent more than the benchmark's frames");
    }
    Ok(())
}

/// A second nodectl process, started with `args`, that prints its address first and its
/// report, one JSON line, last.
pub(super) struct Receiver {
    pub(super) child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    pub(super) addr: Multiaddr,
    pub(super) peer: PeerId,
}

impl Receiver {
    pub(super) fn start(args: &[&str]) -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find the nodectl binary")?;
        let mut child = Command::new(exe)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start the receiving process")?;
        let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
        let addr: Multiaddr = lines
            .next()
            .context("the receiver printed no address")??
            .parse()?;
        let peer = peer_of(&addr)?;
        Ok(Receiver {
            child,
            lines,
            addr,
            peer,
        })
    }

    /// The receiver's report, once it is done, and its exit.
    pub(super) fn finish(mut self) -> Result<serde_json::Value> {
        let report: serde_json::Value = self
            .lines
            .next()
            .context("the receiver printed no report")??
            .parse()?;
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the receiving process failed ({status})");
        }
        Ok(report)
    }
}

async fn send(args: &BenchTransferArgs) -> Result<()> {
    let receiver = Receiver::start(&[
        "--log",
        "error",
        "bench",
        "transfer",
        "--serve",
        "--size-mb",
        &args.size_mb.to_string(),
        "--rounds",
        &args.rounds.to_string(),
        "--transport",
        &args.transport,
    ])?;
    let (addr, peer) = (receiver.addr.clone(), receiver.peer);

    let (client, _events, event_loop) = node(Vec::new())?;
    tokio::spawn(event_loop.run(std::future::pending()));
    client.dial(addr).await?;
    let values: Vec<f32> = (0..(args.size_mb << 20) / 4)
        .map(|i| (i % 7919) as f32)
        .collect();
    let header = TensorHeader::for_payload(MessageKind::Params, RUN, MODEL, 0, &values);
    let mut rates = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds {
        let start = Instant::now();
        let mut stream = client
            .open_stream(peer, StreamProtocol::new(PARAMS_PROTOCOL))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        wire::write_frame(&mut stream, &header, &values).await?;
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).await?;
        let secs = start.elapsed().as_secs_f64();
        // Lets the receiver go on (or end): it waits for this close.
        stream.close().await?;
        rates.push(((args.size_mb << 20) as f64 / 1e6) / secs);
        eprintln!(
            "{} MiB in {:.3} s ({:.0} MB/s)",
            args.size_mb,
            secs,
            rates[rates.len() - 1]
        );
    }
    let memory = receiver.finish()?;
    let median = murmur_trainer::bench::median(&rates);
    let peak = memory["peak_rss_mb"].as_f64().unwrap_or(0.0);
    let baseline = memory["baseline_rss_mb"].as_f64().unwrap_or(0.0);
    if args.json {
        println!(
            "{}",
            json!({
                "bench": "transfer",
                "transport": args.transport,
                "size_mib": args.size_mb,
                "rounds": args.rounds,
                "mb_per_s_median": round(median, 1),
                "mb_per_s": rates.iter().map(|r| round(*r, 1)).collect::<Vec<_>>(),
                "receiver_peak_rss_mb": round(peak, 1),
                "receiver_rss_growth_mb": round(peak - baseline, 1),
            })
        );
    } else {
        println!(
            "{} MiB over {}: median {median:.0} MB/s; receiver memory grew by {:.0} MB",
            args.size_mb,
            args.transport,
            peak - baseline
        );
    }
    Ok(())
}
