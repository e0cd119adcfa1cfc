//! `nodectl bench transfer`: a parameter buffer from this process to a second nodectl process
//! over `/murmur/params/2` on loopback, through the same network stack and frame codec as the
//! daemon. The receiver reads every frame into one reused buffer and acknowledges it with one
//! byte, so each timing covers the whole trip, checksum included.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::network::{
    self, Keypair, Multiaddr, NetworkConfig, NetworkEvent, PeerId, StreamProtocol,
};
use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader};
use serde_json::json;

use crate::cli::BenchTransferArgs;
use crate::report::{peak_rss_mb, round};

const RUN: &str = "bench";
const MODEL: &str = "bench";

fn listen_addr(transport: &str) -> Result<Multiaddr> {
    let text = match transport {
        "tcp" => "/ip4/127.0.0.1/tcp/0",
        "quic" => "/ip4/127.0.0.1/udp/0/quic-v1",
        other => bail!("--transport `{other}`: use `tcp` or `quic`"),
    };
    Ok(text.parse()?)
}

type Node = (
    network::Client,
    tokio::sync::mpsc::Receiver<NetworkEvent>,
    network::EventLoop,
);

fn node(listen: Vec<Multiaddr>) -> Result<Node> {
    let mut config = NetworkConfig::new(Keypair::generate_ed25519(), RUN, MODEL);
    config.mdns = false;
    config.listen = listen;
    Ok(network::new(config)?)
}

pub(super) fn run(args: &BenchTransferArgs) -> Result<()> {
    if args.size_mb == 0 || args.rounds == 0 {
        bail!("--size-mb and --rounds must be positive");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if args.serve {
        runtime.block_on(serve(args))
    } else {
        runtime.block_on(send(args))
    }
}

/// The receiving process: prints its address, receives `rounds` frames, prints its memory.
async fn serve(args: &BenchTransferArgs) -> Result<()> {
    let (client, mut events, event_loop) = node(vec![listen_addr(&args.transport)?])?;
    tokio::spawn(event_loop.run(std::future::pending()));
    let mut incoming = client.accept(StreamProtocol::new(PARAMS_PROTOCOL))?;
    let Some(addr) = network::listen_address(&mut events).await else {
        bail!("the network stopped before it listened");
    };
    // Nothing else reads the events; let them go.
    drop(events);
    println!("{addr}");
    std::io::stdout().flush()?;
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
    }
    println!(
        "{}",
        json!({"peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline})
    );
    Ok(())
}

async fn send(args: &BenchTransferArgs) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the nodectl binary")?;
    let mut child = Command::new(exe)
        .args(["--log", "error", "bench", "transfer", "--serve"])
        .args(["--size-mb", &args.size_mb.to_string()])
        .args(["--rounds", &args.rounds.to_string()])
        .args(["--transport", &args.transport])
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the receiving process")?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let addr: Multiaddr = lines
        .next()
        .context("the receiver printed no address")??
        .parse()?;
    let peer: PeerId = addr
        .iter()
        .find_map(|p| match p {
            libp2p::multiaddr::Protocol::P2p(peer) => Some(peer),
            _ => None,
        })
        .context("the receiver's address has no peer id")?;

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
        rates.push(((args.size_mb << 20) as f64 / 1e6) / secs);
        eprintln!(
            "{} MiB in {:.3} s ({:.0} MB/s)",
            args.size_mb,
            secs,
            rates[rates.len() - 1]
        );
    }
    let memory: serde_json::Value = lines
        .next()
        .context("the receiver printed no memory report")??
        .parse()?;
    let status = child.wait()?;
    if !status.success() {
        bail!("the receiving process failed ({status})");
    }
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
