//! Command-line interface: every subcommand and flag, parsed and checked before anything runs.
//! Every flag also reads a `NODECTL_*` environment variable; a flag on the command line wins.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// nodectl: train one model together with other peers, exchanging parameters, never data.
///
/// `nodectl join --config configs/fashion-mlp-gossip.toml` runs a peer: it trains on its own
/// shard and mixes parameters with the other peers of the run (gossip or elastic averaging,
/// `[sync]` in the config). `nodectl train` trains one replica alone; `nodectl evaluate`
/// scores checkpoints; `testnet/run.sh` runs a whole local network of peers.
#[derive(Debug, Parser)]
#[command(name = "nodectl", version, about, long_about, propagate_version = true)]
#[command(after_help = "Examples:
  nodectl train --config configs/fashion-mlp.toml
  nodectl shard --data /usr/share/datasets/fashion-mnist --peers 4 --partition iid --out shards
  nodectl bench train --model mlp --batch 64 --threads 2 --json
  nodectl config validate configs/fashion-cnn.toml")]
pub struct Cli {
    /// Log filter, e.g. `info`, `debug`, or `info,murmur_trainer=debug`.
    #[arg(
        long,
        global = true,
        env = "NODECTL_LOG",
        default_value = "info,libp2p=warn,quinn=warn"
    )]
    pub log: String,

    /// Log format on standard error: `text` for people, `json` (one object per line, with the
    /// stable `event` names of docs/operations.md) for machines.
    #[arg(
        long,
        global = true,
        env = "NODECTL_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create this node's data dir: a private identity key and the metadata store. Prints the
    /// peer id. Safe to run again: an existing identity is kept.
    Init(DataDirArgs),
    /// Print this node's peer id (from its identity key; the daemon need not run).
    Id(DataDirArgs),
    /// Run this node as a peer of a run: find the other peers (bootstrap addresses, the peer
    /// book, mDNS, the DHT), train on the local data, publish progress, and serve the control
    /// API on loopback. Prints the peer id, its addresses, a line another peer can paste to
    /// join it, and a `ready` line. SIGINT, SIGTERM or `nodectl leave` drain and exit 0.
    Join(JoinArgs),
    /// This node's progress and view of the run (asks the running daemon): peer id, mode,
    /// device, step, loss and accuracy, bytes in and out, time at the staleness gate, and the
    /// live peers with their steps and staleness. `--watch` refreshes it in place.
    Status(StatusArgs),
    /// The live peers of the run with their steps (asks the running daemon).
    Peers(DataDirArgs),
    /// Wait until the daemon sees at least N live peers; exit 1 at the timeout.
    Wait(WaitArgs),
    /// Ask the daemon to leave the run: checkpoint, say goodbye, exit.
    Leave(DataDirArgs),
    /// Train one replica from a run config, with progress, evaluation and checkpoints.
    ///
    /// Resumes from the newest checkpoint in the checkpoint directory when it was written by
    /// the same config; `--fresh` starts over instead.
    Train(TrainArgs),
    /// Test accuracy of checkpoints, and how far apart they are.
    ///
    /// Each PATH is a checkpoint file, a checkpoint directory (its newest checkpoint) or a
    /// node's data dir (the newest in its `checkpoints/`). With two or more, also prints the
    /// consensus distance `max_i ||x_i - mean|| / ||mean||`. For node data dirs it also
    /// reports what the daemon did (from `last-status.json`: steps, bytes sent, exchanges,
    /// staleness) and the elastic center in `checkpoints/center.safetensors` if there is one.
    Evaluate(EvaluateArgs),
    /// Print text a language model (`[model] kind = "gpt"`) writes from a checkpoint: it
    /// continues the prompt one byte at a time, each drawn from its prediction.
    #[command(
        after_help = "Examples:\n  nodectl sample -c configs/shakespeare-gpt.toml\n  \
        nodectl sample -c configs/shakespeare-gpt-swarm.toml testnet/run/node-0 \
        --prompt 'ROMEO:' --tokens 300"
    )]
    Sample(SampleArgs),
    /// Write datasets: `nodectl dataset synthetic` makes a small Fashion-MNIST-shaped one
    /// for trying things out without the real data.
    #[command(subcommand)]
    Dataset(DatasetCommand),
    /// Split a dataset into one shard per peer, and write a manifest of what each got.
    Shard(ShardArgs),
    /// Measure performance on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Work with run config files.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Manage the peers this node trusts with `allreduce` rings and the elastic center
    /// (`[trust] peers` in the node config; comments and other keys are kept). A running daemon
    /// reads the list at start: restart it to apply a change.
    #[command(subcommand)]
    Trust(TrustCommand),
}

#[derive(Debug, Subcommand)]
pub enum TrustCommand {
    /// Trust a peer (its id from `nodectl id` on that machine).
    #[command(after_help = "Example:\n  nodectl trust add 12D3KooWQx...  --data-dir /srv/murmur")]
    Add {
        /// The peer id to trust.
        peer_id: String,
        #[command(flatten)]
        node: DataDirArgs,
    },
    /// Stop trusting a peer.
    Rm {
        /// The peer id to remove.
        peer_id: String,
        #[command(flatten)]
        node: DataDirArgs,
    },
    /// List the trusted peers and whether the allowlist is on.
    Ls(DataDirArgs),
}

#[derive(Debug, Args)]
pub struct DataDirArgs {
    /// The node's data dir (default: $XDG_DATA_HOME/murmur or ~/.local/share/murmur).
    #[arg(long, env = "NODECTL_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Print the result as JSON on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

impl DataDirArgs {
    pub fn data_dir(&self) -> crate::store::DataDir {
        crate::store::DataDir::new(
            self.data_dir
                .clone()
                .unwrap_or_else(crate::store::DataDir::default_root),
        )
    }
}

#[derive(Debug, Args)]
pub struct JoinArgs {
    /// Run config (TOML), e.g. configs/fashion-mlp.toml. Every peer of a run uses the same one.
    #[arg(long, short, env = "NODECTL_CONFIG")]
    pub config: PathBuf,
    #[command(flatten)]
    pub node: DataDirArgs,
    /// Address to listen on (repeatable; default from the node config: all interfaces, TCP
    /// and QUIC, free ports).
    #[arg(long, env = "NODECTL_LISTEN", value_delimiter = ',')]
    pub listen: Vec<String>,
    /// Peer to dial at start, e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... (repeatable).
    #[arg(long, env = "NODECTL_BOOTSTRAP", value_delimiter = ',')]
    pub bootstrap: Vec<String>,
    /// Do not look for peers by multicast DNS.
    #[arg(long, env = "NODECTL_NO_MDNS")]
    pub no_mdns: bool,
    /// Control API address, loopback only (default from the node config: 127.0.0.1:0).
    #[arg(long, env = "NODECTL_API")]
    pub api: Option<String>,
    /// Dataset directory (overrides `data.dir`).
    #[arg(long, env = "NODECTL_DATA")]
    pub data: Option<PathBuf>,
    /// This node's shard directory from `nodectl shard` (overrides `data.shard`).
    #[arg(long, env = "NODECTL_SHARD")]
    pub shard: Option<PathBuf>,
    /// Compute threads (overrides `training.threads`).
    #[arg(long, env = "NODECTL_THREADS")]
    pub threads: Option<usize>,
    /// Most steps this node may run ahead of the slowest live peer, or `off` (overrides
    /// `sync.max_staleness`).
    #[arg(long, env = "NODECTL_MAX_STALENESS")]
    pub max_staleness: Option<String>,
    /// Testing knob: run this many times slower than the machine allows (overrides
    /// `sync.slowdown`).
    #[arg(long, env = "NODECTL_SLOWDOWN")]
    pub slowdown: Option<f64>,
    /// Seconds without a heartbeat after which a peer counts as gone.
    #[arg(long, env = "NODECTL_PEER_TIMEOUT", default_value_t = 10)]
    pub peer_timeout_secs: u64,
    /// MiB the pair copies of compressed exchanges may hold, about 4 bytes a parameter for
    /// each partner kept (overrides the node config's `[memory] pair_copies_mib`).
    #[arg(long, env = "NODECTL_PAIR_COPIES_MIB")]
    pub pair_copies_mib: Option<u64>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub node: DataDirArgs,
    /// Refresh until interrupted (Ctrl-C): in place on a terminal, one JSON line per refresh
    /// with `--json`.
    #[arg(long, short, env = "NODECTL_WATCH")]
    pub watch: bool,
    /// Seconds between refreshes with `--watch`.
    #[arg(long, env = "NODECTL_INTERVAL", default_value_t = 1.0)]
    pub interval: f64,
}

#[derive(Debug, Args)]
pub struct WaitArgs {
    #[command(flatten)]
    pub node: DataDirArgs,
    /// Live peers to wait for (this node not counted).
    #[arg(long, env = "NODECTL_MIN_PEERS")]
    pub min_peers: usize,
    /// Seconds to wait before giving up.
    #[arg(long, env = "NODECTL_TIMEOUT", default_value_t = 30.0)]
    pub timeout: f64,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Run config (TOML), e.g. configs/fashion-mlp.toml.
    #[arg(long, short, env = "NODECTL_CONFIG")]
    pub config: PathBuf,
    /// Dataset directory with the Fashion-MNIST IDX files (overrides `data.dir`).
    #[arg(long, env = "NODECTL_DATA")]
    pub data: Option<PathBuf>,
    /// Train on this shard directory from `nodectl shard` (overrides `data.shard`).
    #[arg(long, env = "NODECTL_SHARD")]
    pub shard: Option<PathBuf>,
    /// Number of epochs (overrides `training.epochs`).
    #[arg(long, env = "NODECTL_EPOCHS")]
    pub epochs: Option<u64>,
    /// Compute threads (overrides `training.threads`; default every core).
    #[arg(long, env = "NODECTL_THREADS")]
    pub threads: Option<usize>,
    /// Seed of initialisation and data order (overrides `run.seed`).
    #[arg(long, env = "NODECTL_SEED")]
    pub seed: Option<u64>,
    /// Where checkpoints go (overrides `checkpoint.dir`).
    #[arg(long, env = "NODECTL_CHECKPOINT_DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Ignore and delete existing checkpoints in the checkpoint directory, and start over.
    #[arg(long, env = "NODECTL_FRESH")]
    pub fresh: bool,
    /// Print one JSON object with the results on stdout at the end.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SampleArgs {
    /// Run config the checkpoint was trained with (a `gpt`).
    #[arg(long, short, env = "NODECTL_CONFIG")]
    pub config: PathBuf,
    /// A checkpoint file, a checkpoint directory (its newest) or a node's data dir (the
    /// newest in its `checkpoints/`). Default: the config's checkpoint directory.
    pub path: Option<PathBuf>,
    /// Text the model continues. Default: a newline.
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Bytes (tokens) to write.
    #[arg(long, default_value_t = 500)]
    pub tokens: usize,
    /// Below 1 the model's likeliest guesses gain, above 1 the rest do.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Draw among the K likeliest bytes only (0: among all).
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    /// Seed of the draws: the same seed and checkpoint give the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object (checkpoint, step, prompt, text) on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct EvaluateArgs {
    /// Run config the checkpoints were trained with.
    #[arg(long, short, env = "NODECTL_CONFIG")]
    pub config: PathBuf,
    /// Dataset directory whose test split is used (overrides `data.dir`).
    #[arg(long, env = "NODECTL_DATA")]
    pub data: Option<PathBuf>,
    /// Checkpoint files, checkpoint directories or node data dirs.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Test accuracy (0..1) whose time to reach is reported, from the nodes' evaluation
    /// history in `<data-dir>/last-status.json`: for the mean of the nodes, and per node. For
    /// a language model (`gpt`), a validation loss to fall to.
    #[arg(long, env = "NODECTL_TARGET")]
    pub target: Option<f64>,
    /// Print one JSON object on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum DatasetCommand {
    /// Write a synthetic dataset (28x28 images of 10 noisy class prototypes) as the four
    /// Fashion-MNIST IDX files, usable wherever `--data` is.
    Synthetic {
        /// Output directory.
        #[arg(long, env = "NODECTL_OUT")]
        out: PathBuf,
        /// Training samples.
        #[arg(long, default_value_t = 4096)]
        train: usize,
        /// Test samples.
        #[arg(long, default_value_t = 1024)]
        test: usize,
        /// Seed of the samples (the class prototypes are the same for every seed).
        #[arg(long, env = "NODECTL_SEED", default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Debug, Args)]
pub struct ShardArgs {
    /// Dataset directory whose training split is divided; a directory of `.txt` documents
    /// (a text corpus) is dealt as text, its last tenth of each document left out for
    /// validation.
    #[arg(long, env = "NODECTL_DATA", default_value = murmur_trainer::data::DEFAULT_DATA_DIR)]
    pub data: PathBuf,
    /// Number of shards, one per peer.
    #[arg(long, env = "NODECTL_PEERS")]
    pub peers: usize,
    /// Images: `iid`, `dirichlet:ALPHA` (label skew; smaller is more skewed) or `labels:K`
    /// (K labels per peer). Text: `iid` (blocks of every document dealt at random) or
    /// `documents` (whole documents, such as plays, each to one peer).
    #[arg(long, env = "NODECTL_PARTITION", default_value = "iid")]
    pub partition: String,
    /// Seed of the split; the same seed gives the same shards.
    #[arg(long, env = "NODECTL_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Output directory: `shard-000/`, `shard-001/`, ... and `manifest.json`.
    #[arg(long, env = "NODECTL_OUT")]
    pub out: PathBuf,
    /// Replace shards already in the output directory.
    #[arg(long, env = "NODECTL_FORCE")]
    pub force: bool,
    /// Print the manifest as JSON on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Time the real training step (forward, backward, SGD update) on one fixed synthetic
    /// batch, and the machine's sgemm peak for comparison.
    Train(BenchTrainArgs),
    /// Time moving a parameter buffer between two nodectl processes over `/murmur/params/3`
    /// on loopback (the daemon's network stack and frame codec), and the receiver's memory.
    Transfer(BenchTransferArgs),
    /// Ring all-reduce between separate nodectl processes on loopback: for each peer count,
    /// data plane and buffer size, the median time, algbw and busbw (busbw = algbw x 2(p-1)/p,
    /// the nccl-tests definition) and the bytes each peer sent.
    Allreduce(BenchAllreduceArgs),
    /// Simulate a swarm and time it: many nodes of the engine itself (membership, sync engine,
    /// replica driver) on a simulated network in virtual time, each replica a few values. How
    /// fast a large run's work is done. The simulator is not in a release build: build nodectl
    /// with it first (`cargo build --release -p murmur-daemon --features sim`).
    Sim(BenchSimArgs),
    /// Time one pairwise exchange of a model of N parameters, stage by stage (difference and
    /// encoding, writing the frame, reading and decoding the partner's, judging, mixing),
    /// through the protocol machines and wire frames a node runs, both sides in this process;
    /// and the memory it takes above the replicas and the pair's copies. Set the time of a side
    /// against the time its frame takes on a link (`nodectl bench transfer`).
    Exchange(BenchExchangeArgs),
}

#[derive(Debug, Args)]
pub struct BenchExchangeArgs {
    /// Model sizes in parameters, comma-separated; `k`, `M` and `B` stand for thousand,
    /// million and billion (`1M,10M,100M`). Both sides are on this machine: each size needs
    /// about 8 times its f32 bytes of memory, and more with a dense exchange.
    #[arg(
        long,
        env = "NODECTL_BENCH_PARAMS",
        value_delimiter = ',',
        value_parser = parse_count,
        default_value = "1M,10M,100M"
    )]
    pub params: Vec<usize>,
    /// The exchange's codec, as `sync.codec` names it: `int8`, `int4`, `topk`, `bf16` or `f32`.
    #[arg(long, env = "NODECTL_BENCH_CODEC", default_value = "int8")]
    pub codec: String,
    /// Timed exchanges per size, after one that warms the pair's copies; the median is
    /// reported.
    #[arg(long, env = "NODECTL_BENCH_ROUNDS", default_value_t = 3)]
    pub rounds: usize,
    /// Seed of the two replicas.
    #[arg(long, env = "NODECTL_BENCH_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Run the two sides as two nodes do: in two processes, the frames over loopback on this
    /// transport (`tcp` or `quic`) through the daemon's network stack. Reports each exchange's
    /// whole time beside a plain frame of the same bytes on the same connection, and each
    /// side's memory. Without it, both sides run in this process and each stage is timed.
    #[arg(long, env = "NODECTL_BENCH_TRANSPORT")]
    pub transport: Option<String>,
    /// Print one JSON object per size on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
    /// Answer the exchanges of an initiator on another machine (`--partner`): prints this
    /// side's address (with its peer id) first, answers each size of `--params` in turn, and
    /// prints its memory for each as one JSON line. Start both sides with the same `--params`,
    /// `--codec`, `--rounds` and `--transport`.
    #[arg(long, requires = "transport", conflicts_with = "partner")]
    pub serve: bool,
    /// With `--serve`: where to listen, e.g. `/ip4/0.0.0.0/tcp/9100` or
    /// `/ip4/0.0.0.0/udp/9100/quic-v1`. Default: loopback, a free port.
    #[arg(long, requires = "serve")]
    pub listen: Option<String>,
    /// Offer the exchanges to a side started with `--serve` at this address (the one it
    /// printed, `/p2p/` peer id included; its host as this machine reaches it) instead of a
    /// second process on this machine: the exchange over a real link.
    #[arg(long, requires = "transport")]
    pub partner: Option<String>,
}

/// A count with an optional `k`, `M` or `B` suffix (thousand, million, billion): `100M`.
fn parse_count(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, scale) = match text.char_indices().last() {
        Some((i, 'k' | 'K')) => (&text[..i], 1_000),
        Some((i, 'M' | 'm')) => (&text[..i], 1_000_000),
        Some((i, 'B' | 'b' | 'G' | 'g')) => (&text[..i], 1_000_000_000),
        _ => (text, 1),
    };
    let value: f64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a count: write 1000000, 1M or 1.5B"))?;
    let count = value * scale as f64;
    if !(count >= 1.0 && count <= usize::MAX as f64) {
        return Err(format!("`{text}`: a count of at least 1"));
    }
    Ok(count as usize)
}

#[derive(Debug, Args)]
pub struct BenchSimArgs {
    /// Simulated peers.
    #[arg(long, env = "NODECTL_BENCH_PEERS", default_value_t = 64)]
    pub peers: usize,
    /// Local steps every peer takes.
    #[arg(long, env = "NODECTL_BENCH_STEPS", default_value_t = 10_000)]
    pub steps: u64,
    /// `gossip`, `elastic` or `allreduce`.
    #[arg(long, env = "NODECTL_BENCH_MODE", default_value = "gossip")]
    pub mode: String,
    /// Seed of the run.
    #[arg(long, env = "NODECTL_BENCH_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchAllreduceArgs {
    /// Peer counts to run, each with its own set of processes (comma-separated).
    #[arg(
        long,
        env = "NODECTL_BENCH_PEERS",
        value_delimiter = ',',
        default_value = "2,4"
    )]
    pub peers: Vec<usize>,
    /// Buffer sizes in MiB (comma-separated).
    #[arg(
        long,
        env = "NODECTL_BENCH_SIZES_MB",
        value_delimiter = ',',
        default_value = "1,16,100"
    )]
    pub sizes_mb: Vec<f64>,
    /// Data planes to measure: `tcp` (token-admitted TCP) and `libp2p` (encrypted streams).
    #[arg(
        long,
        env = "NODECTL_BENCH_PLANES",
        value_delimiter = ',',
        default_value = "tcp,libp2p"
    )]
    pub planes: Vec<BenchPlane>,
    /// Timed all-reduces per size; the median is reported.
    #[arg(long, env = "NODECTL_BENCH_ITERS", default_value_t = 10)]
    pub iters: usize,
    /// Untimed all-reduces before the timed ones.
    #[arg(long, env = "NODECTL_BENCH_WARMUP", default_value_t = 3)]
    pub warmup: usize,
    /// Sub-chunk size in KiB: the unit that is sent, received and added while the next one
    /// is in flight.
    #[arg(long, env = "NODECTL_BENCH_SUB_CHUNK_KB", default_value_t = 1024)]
    pub sub_chunk_kb: usize,
    /// Print one JSON object per peer count and plane on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
    /// Internal: run as one of the peers.
    #[arg(long, hide = true)]
    pub worker: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchPlane {
    Tcp,
    Libp2p,
}

#[derive(Debug, Args)]
pub struct BenchTransferArgs {
    /// Buffer size in MiB.
    #[arg(long, env = "NODECTL_BENCH_SIZE_MB", default_value_t = 100)]
    pub size_mb: usize,
    /// Timed transfers; the median is reported.
    #[arg(long, env = "NODECTL_BENCH_ROUNDS", default_value_t = 5)]
    pub rounds: usize,
    /// `tcp` or `quic`.
    #[arg(long, env = "NODECTL_BENCH_TRANSPORT", default_value = "tcp")]
    pub transport: String,
    /// Print one JSON object on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
    /// Internal: run as the receiving process.
    #[arg(long, hide = true)]
    pub serve: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchModel {
    Mlp,
    Cnn,
    /// nanoGPT's CPU configuration: 4 layers, 4 heads, width 128, context 64, byte vocabulary;
    /// `--batch` counts sequences of 64 tokens.
    Gpt,
}

#[derive(Debug, Args)]
pub struct BenchTrainArgs {
    /// Model with its default layer sizes (mlp: 784-256-128-10; gpt: nanoGPT's CPU
    /// configuration, timed with AdamW on sequences of 64 tokens).
    #[arg(long, env = "NODECTL_BENCH_MODEL", default_value = "mlp")]
    pub model: BenchModel,
    /// Samples per step.
    #[arg(long, env = "NODECTL_BENCH_BATCH", default_value_t = 64)]
    pub batch: usize,
    /// Compute threads of the CPU backend (default every core).
    #[arg(long, env = "NODECTL_THREADS")]
    pub threads: Option<usize>,
    /// Where to train: `auto` (the first GPU if one answers, else the CPU), `cpu`, `cuda` or
    /// `cuda:N`.
    #[arg(long, env = "NODECTL_DEVICE", default_value = "auto")]
    pub device: crate::config::Device,
    /// Timed trials; the median is reported.
    #[arg(long, env = "NODECTL_BENCH_TRIALS", default_value_t = 7)]
    pub trials: u32,
    /// Seconds per trial.
    #[arg(long, env = "NODECTL_BENCH_TRIAL_SECS", default_value_t = 2.0)]
    pub trial_secs: f64,
    /// Untimed steps before the first trial.
    #[arg(long, env = "NODECTL_BENCH_WARMUP", default_value_t = 50)]
    pub warmup: u32,
    /// Side of the square GEMM that measures the sgemm peak (0 skips it).
    #[arg(long, env = "NODECTL_BENCH_PEAK_SIZE", default_value_t = 1024)]
    pub peak_size: usize,
    /// Print one JSON object on stdout.
    #[arg(long, env = "NODECTL_JSON")]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a run config without starting anything: syntax, keys, types and values.
    Validate {
        /// The TOML file to check.
        file: PathBuf,
        /// Print the result as JSON on stdout.
        #[arg(long, env = "NODECTL_JSON")]
        json: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_count_takes_a_suffix_and_a_wrong_one_is_named() {
        assert_eq!(parse_count("1000"), Ok(1000));
        assert_eq!(parse_count("85M"), Ok(85_000_000));
        assert_eq!(parse_count(" 1.5B"), Ok(1_500_000_000));
        assert_eq!(parse_count("2k"), Ok(2000));
        assert!(
            parse_count("ten")
                .unwrap_err()
                .contains("`ten` is not a count")
        );
        assert!(parse_count("0").is_err());
    }
}
