//! `wanlink`: the testnet's emulated wide-area links (see the library's documentation).
//! testnet/netns.sh starts the switch; the probes measure a link.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use clap::{Parser, Subcommand};
use murmur_wanlink::profile::Profile;
use murmur_wanlink::{probe, switch};

/// Emulated wide-area links between the testnet's network namespaces.
#[derive(Debug, Parser)]
#[command(name = "wanlink", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Forward frames between the given interfaces, each frame delayed and dropped as its
    /// path's profiles say. Runs until killed; prints `ready` once every port is open. Needs
    /// root (raw sockets).
    Switch {
        /// A port: INTERFACE=PROFILE, such as port0=100mbit,25 (the profile's rate is applied
        /// by tc, not here). Give one per peer.
        #[arg(long = "port", value_name = "INTERFACE=PROFILE", required = true, value_parser = parse_port)]
        ports: Vec<switch::Port>,
        /// Seed of the loss draws.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Frames above this size are dropped; it must cover the links' MTU and headers.
        #[arg(long, default_value_t = 1600)]
        max_frame: usize,
    },
    /// Check a link profile and print it as `RATE_KBIT DELAY_MS LOSS_PCT` (for the scripts).
    Profile {
        /// `RATE[,DELAY_MS[,LOSS_PCT]]`, such as 20mbit,50 or 5mbit,100,1.
        profile: Profile,
    },
    /// Measure a link: run `serve` on one side, a measurement on the other.
    #[command(subcommand)]
    Probe(ProbeCommand),
}

#[derive(Debug, Subcommand)]
enum ProbeCommand {
    /// Answer probes on ADDR (TCP echo and sink, UDP echo) until killed.
    Serve { listen: SocketAddr },
    /// Median round-trip time of one-byte TCP echoes.
    Rtt {
        to: SocketAddr,
        #[arg(long, default_value_t = 20)]
        count: usize,
    },
    /// Throughput of a bulk TCP transfer of BYTES.
    Throughput {
        to: SocketAddr,
        #[arg(long, default_value_t = 4_000_000)]
        bytes: u64,
    },
    /// One-way loss estimated from UDP echoes.
    Loss {
        to: SocketAddr,
        #[arg(long, default_value_t = 2000)]
        count: usize,
        /// Pause between datagrams, in microseconds.
        #[arg(long, default_value_t = 500)]
        gap_us: u64,
    },
    /// The public address one UDP socket shows each of the given probe servers (two servers
    /// tell an endpoint-independent NAT mapping from a symmetric one).
    Mapping {
        #[arg(required = true)]
        servers: Vec<SocketAddr>,
        /// The local UDP port (0: any).
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
    /// A UDP hole punch towards PEER's public address; run it on both peers at once.
    Punch {
        peer: SocketAddr,
        /// The local UDP port, which the peer punches towards (through this side's NAT).
        #[arg(long)]
        port: u16,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
    },
}

fn parse_port(text: &str) -> Result<switch::Port, String> {
    let (interface, profile) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not INTERFACE=PROFILE"))?;
    Ok(switch::Port {
        interface: interface.to_owned(),
        profile: profile.parse().map_err(|e| format!("{e}"))?,
    })
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Switch {
            ports,
            seed,
            max_frame,
        } => switch::run(&ports, seed, max_frame),
        Command::Profile { profile } => {
            println!(
                "{} {} {}",
                profile.rate_kbit, profile.delay_ms, profile.loss_pct
            );
            Ok(())
        }
        Command::Probe(probe) => {
            let json = match probe {
                ProbeCommand::Serve { listen } => return probe::serve(listen),
                ProbeCommand::Rtt { to, count } => serde_json::to_string(&probe::rtt(to, count)?)?,
                ProbeCommand::Throughput { to, bytes } => {
                    serde_json::to_string(&probe::throughput(to, bytes)?)?
                }
                ProbeCommand::Loss { to, count, gap_us } => {
                    serde_json::to_string(&probe::loss(to, count, Duration::from_micros(gap_us))?)?
                }
                ProbeCommand::Mapping { servers, port } => {
                    serde_json::to_string(&probe::mapping(&servers, port)?)?
                }
                ProbeCommand::Punch {
                    peer,
                    port,
                    seconds,
                } => serde_json::to_string(&probe::punch(
                    peer,
                    port,
                    Duration::from_secs_f64(seconds),
                )?)?,
            };
            println!("{json}");
            Ok(())
        }
    }
}
