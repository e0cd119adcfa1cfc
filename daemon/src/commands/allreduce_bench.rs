//! `nodectl bench allreduce`: the ring all-reduce between `p` separate nodectl processes on
//! loopback, through the daemon's code path: libp2p control plane, ring set-up with its
//! handshake (and the TCP token admission), and [`ring::all_reduce`] on the chosen data plane.
//!
//! Like torch.distributed's benchmark, each timed all-reduce starts after a barrier (a one-value
//! all-reduce) and its time is the slowest peer's (the peers all-reduce their times). The buffer
//! is refilled with ones before each round and checked afterwards.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use murmur_protocol::RING_PROTOCOL;
use murmur_protocol::network::{
    self, Keypair, Multiaddr, NetworkConfig, NetworkEvent, StreamProtocol,
};
use murmur_protocol::ring::data_plane::{self, DataReader, DataWriter, TcpDataListener};
use murmur_protocol::ring::{self, Attempt, DataPlane, RingLinks, RingMembers, RingSchedule};
use murmur_protocol::trust::TrustList;
use serde_json::{Value, json};

use crate::cli::{BenchAllreduceArgs, BenchPlane};
use crate::report::round;

const RUN: &str = "bench-allreduce";
/// No single round of the benchmark may take longer than this.
const ROUND_TIMEOUT: Duration = Duration::from_secs(120);

impl From<BenchPlane> for DataPlane {
    fn from(plane: BenchPlane) -> Self {
        match plane {
            BenchPlane::Tcp => DataPlane::Tcp,
            BenchPlane::Libp2p => DataPlane::Libp2p,
        }
    }
}

pub(super) fn run(args: &BenchAllreduceArgs) -> Result<()> {
    ensure!(
        args.iters > 0 && args.sub_chunk_kb > 0,
        "--iters and --sub-chunk-kb must be positive"
    );
    ensure!(
        args.sizes_mb.iter().all(|&mb| mb.is_finite() && mb > 0.0),
        "--sizes-mb must be positive numbers of MiB"
    );
    ensure!(
        args.peers.iter().all(|&p| (2..=64).contains(&p)),
        "--peers must be between 2 and 64"
    );
    if args.worker {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        return runtime.block_on(worker(args));
    }
    for &peers in &args.peers {
        for &plane in &args.planes {
            let result = drive(args, peers, plane.into())?;
            if args.json {
                println!("{result}");
            } else {
                print_table(&result);
            }
        }
    }
    Ok(())
}

fn print_table(result: &Value) {
    println!(
        "p = {}, {} data plane:",
        result["peers"],
        result["plane"].as_str().unwrap_or("?")
    );
    for size in result["sizes"].as_array().into_iter().flatten() {
        println!(
            "  {:>6} MiB  {:>9.3} ms  algbw {:.3} GB/s  busbw {:.3} GB/s  sent {:.4}x the lower bound",
            size["mib"],
            size["time_ms_median"].as_f64().unwrap_or(f64::NAN),
            size["algbw_gbps_median"].as_f64().unwrap_or(f64::NAN),
            size["busbw_gbps_median"].as_f64().unwrap_or(f64::NAN),
            size["bytes_sent_vs_lower_bound"]
                .as_f64()
                .unwrap_or(f64::NAN),
        );
    }
}

/// Kills the workers if the driver gives up half-way.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `peers` worker processes on `plane`, introduces them to each other and collects the
/// one report the rank-0 worker prints.
fn drive(args: &BenchAllreduceArgs, peers: usize, plane: DataPlane) -> Result<Value> {
    eprintln!("all-reduce: {peers} processes, {plane} data plane");
    let exe = std::env::current_exe().context("cannot find the nodectl binary")?;
    let sizes: Vec<String> = args.sizes_mb.iter().map(f64::to_string).collect();
    let mut workers = Workers(Vec::new());
    for _ in 0..peers {
        let child = Command::new(&exe)
            .args(["--log", "error", "bench", "allreduce", "--worker"])
            .args(["--peers", &peers.to_string()])
            .args(["--planes", &plane.to_string()])
            .args(["--sizes-mb", &sizes.join(",")])
            .args(["--iters", &args.iters.to_string()])
            .args(["--warmup", &args.warmup.to_string()])
            .args(["--sub-chunk-kb", &args.sub_chunk_kb.to_string()])
            .env_remove("NODECTL_JSON")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start a worker process")?;
        workers.0.push(child);
    }
    let mut outputs = Vec::new();
    let mut addrs = Vec::new();
    for child in &mut workers.0 {
        let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
        addrs.push(lines.next().context("a worker printed no address")??);
        outputs.push(lines);
    }
    let everyone = addrs.join(" ") + "\n";
    for child in &mut workers.0 {
        let mut stdin = child.stdin.take().context("no stdin")?;
        stdin.write_all(everyone.as_bytes())?;
    }
    let mut report = None;
    for lines in outputs {
        for line in lines {
            let line = line?;
            match serde_json::from_str::<Value>(&line) {
                Ok(value) => report = Some(value),
                Err(_) => eprintln!("{line}"),
            }
        }
    }
    for child in &mut workers.0 {
        let status = child.wait()?;
        if !status.success() {
            bail!("a worker failed ({status}); rerun with --log info to see why");
        }
    }
    workers.0.clear();
    report.context("no worker reported results")
}

/// One peer: joins the others, sets the ring up and runs every size.
async fn worker(args: &BenchAllreduceArgs) -> Result<()> {
    let [peers] = args.peers[..] else {
        bail!("a worker runs one peer count");
    };
    let [plane] = args.planes[..] else {
        bail!("a worker runs one data plane");
    };
    let plane = DataPlane::from(plane);
    let mut config = NetworkConfig::new(Keypair::generate_ed25519(), RUN, RUN);
    config.mdns = false;
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    let (client, mut events, event_loop) = network::new(config)?;
    tokio::spawn(event_loop.run(std::future::pending()));
    let mut incoming = client.accept(StreamProtocol::new(RING_PROTOCOL))?;
    let Some(addr) = network::listen_address(&mut events).await else {
        bail!("the network stopped before it listened");
    };
    // The listen address already ends in this node's peer id.
    println!("{addr}");
    std::io::stdout().flush()?;

    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let mut members = Vec::new();
    let mut dial = false;
    for text in line.split_whitespace() {
        let addr: Multiaddr = text.parse()?;
        let peer = addr
            .iter()
            .find_map(|p| match p {
                libp2p::multiaddr::Protocol::P2p(peer) => Some(peer),
                _ => None,
            })
            .context("a worker address without a peer id")?;
        // Each pair is dialled once: by the one that comes first in the list.
        if peer == client.peer_id() {
            dial = true;
        } else if dial {
            client.dial(addr).await?;
        }
        members.push(peer);
    }
    ensure!(members.len() == peers, "expected {peers} worker addresses");
    // Every pair must be connected before the ring is: the later one of a pair has no address
    // for the earlier one until it dials in.
    let mut waiting: std::collections::HashSet<_> = members
        .iter()
        .filter(|&&p| p != client.peer_id())
        .copied()
        .collect();
    tokio::time::timeout(ROUND_TIMEOUT, async {
        while !waiting.is_empty() {
            match events.recv().await {
                Some(NetworkEvent::Connected(peer)) => {
                    waiting.remove(&peer);
                }
                Some(_) => {}
                None => bail!("the network stopped"),
            }
        }
        Ok(())
    })
    .await
    .context("the workers did not connect")??;
    let members = RingMembers::new(RUN, members);
    let me = client.peer_id();
    let rank = members.rank_of(&me).context("not among the workers")?;

    let tcp = match plane {
        DataPlane::Tcp => Some(TcpDataListener::bind(([127, 0, 0, 1], 0).into()).await?),
        DataPlane::Libp2p => None,
    };
    let links = tokio::time::timeout(
        ROUND_TIMEOUT,
        data_plane::connect_ring(
            &client,
            &mut incoming,
            &mut None,
            &TrustList::new(members.peers().iter().copied()),
            RUN,
            &members,
            me,
            plane,
            tcp.as_ref(),
            Attempt::first(0),
        ),
    )
    .await
    .context("ring set-up timed out")??;
    drop(events);

    let mut bench = Bench {
        links: Some(links),
        round: 0,
        rank,
        peers,
        membership: members.hash(),
        sub_chunk: (args.sub_chunk_kb * 1024 / 4).max(1),
    };
    let mut sizes = Vec::new();
    for &mib in &args.sizes_mb {
        let bytes = (mib * f64::from(1u32 << 20)) as usize / 4 * 4;
        sizes.push(bench.size(bytes / 4, args.warmup, args.iters, mib).await?);
    }
    if rank == 0 {
        let report = json!({
            "bench": "allreduce",
            "peers": peers,
            "plane": plane.to_string(),
            "sub_chunk_bytes": bench.sub_chunk * 4,
            "iters": args.iters,
            "warmup": args.warmup,
            "sizes": sizes,
        });
        println!("{report}");
    }
    Ok(())
}

struct Bench {
    links: Option<RingLinks<DataReader, DataWriter>>,
    round: u64,
    rank: usize,
    peers: usize,
    membership: u64,
    sub_chunk: usize,
}

impl Bench {
    /// One all-reduce of `buffer` on the shared links.
    async fn all_reduce(&mut self, buffer: &mut [f32]) -> Result<ring::RoundTraffic> {
        let schedule = RingSchedule::new(self.rank, self.peers, buffer.len(), self.sub_chunk);
        let links = self.links.take().context("the ring broke earlier")?;
        let round = ring::all_reduce(schedule, self.round, self.membership, buffer, links);
        let (traffic, links) = tokio::time::timeout(ROUND_TIMEOUT, round)
            .await
            .with_context(|| format!("round {} timed out", self.round))??;
        self.links = Some(links);
        self.round += 1;
        Ok(traffic)
    }

    /// Times `iters` all-reduces of `len` values after `warmup` untimed ones.
    async fn size(&mut self, len: usize, warmup: usize, iters: usize, mib: f64) -> Result<Value> {
        let mut buffer = vec![1.0f32; len];
        let mut times = Vec::new();
        let mut sent = Vec::new();
        let mut written = Vec::new();
        for iteration in 0..warmup + iters {
            buffer.fill(1.0);
            self.all_reduce(&mut [1.0]).await?;
            let before = bytes_written();
            let start = Instant::now();
            let traffic = self.all_reduce(&mut buffer).await?;
            let secs = start.elapsed().as_secs_f64();
            let after = bytes_written();
            let expected = self.peers as f32;
            ensure!(
                buffer.first().is_none_or(|&v| v == expected)
                    && buffer.last().is_none_or(|&v| v == expected),
                "wrong sum: {:?} instead of {expected}",
                buffer.first()
            );
            let mut slowest = vec![0.0f32; self.peers];
            slowest[self.rank] = secs as f32;
            self.all_reduce(&mut slowest).await?;
            if iteration >= warmup {
                times.push(slowest.iter().copied().fold(0.0f32, f32::max) as f64);
                sent.push(traffic.bytes_sent);
                written.push(after.zip(before).map(|(a, b)| a - b));
            }
        }
        let bytes = (len * 4) as f64;
        let factor = murmur_protocol::ring::bus_factor(self.peers);
        let median = murmur_trainer::bench::median(&times);
        let algbw: Vec<f64> = times.iter().map(|t| bytes / t / 1e9).collect();
        let lower_bound = factor * bytes;
        let sent_median = sent[sent.len() / 2] as f64;
        let written: Option<Vec<u64>> = written.into_iter().collect();
        Ok(json!({
            "mib": mib,
            "bytes": len * 4,
            "time_ms_median": round(median * 1e3, 3),
            "algbw_gbps_median": round(bytes / median / 1e9, 4),
            "busbw_gbps_median": round(bytes / median / 1e9 * factor, 4),
            "time_ms": times.iter().map(|t| round(t * 1e3, 3)).collect::<Vec<_>>(),
            "algbw_gbps": algbw.iter().map(|a| round(*a, 4)).collect::<Vec<_>>(),
            "bytes_sent_per_peer": sent_median,
            "lower_bound_bytes": lower_bound,
            "bytes_sent_vs_lower_bound": round(sent_median / lower_bound, 6),
            "syscall_bytes_written_per_peer": written.map(|w| w[w.len() / 2]),
        }))
    }
}

/// Bytes this process has handed to `write`-like system calls so far (Linux), which counts every
/// framing layer below the ring's own: Yamux and Noise on the libp2p plane.
fn bytes_written() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
}
