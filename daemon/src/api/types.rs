//! What the control API answers, as JSON: the reports of `GET /status`, `/peers` and
//! `/history`. The daemon builds them from its read side; `nodectl status` and friends, and
//! `nodectl evaluate` (from `last-status.json`), read them back.

use serde::{Deserialize, Serialize};

/// `GET /status`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusReport {
    pub peer_id: String,
    pub run_id: String,
    pub fingerprint: String,
    pub model: String,
    /// The device the replica trains on (`cpu`, `cuda:0`).
    #[serde(default)]
    pub device: String,
    /// `training`, `finished` or `leaving`.
    pub state: String,
    pub step: u64,
    pub epoch: u64,
    pub epochs: u64,
    pub loss_ema: f32,
    pub test_accuracy: Option<f64>,
    /// Mean loss on the test set at the last evaluation: for a language model, the
    /// validation loss (cross-entropy per token, in nats).
    #[serde(default)]
    pub test_loss: Option<f64>,
    pub samples_seen: u64,
    pub live_peers: usize,
    /// The live peers, as `GET /peers` lists them.
    #[serde(default)]
    pub peers: Vec<PeerReport>,
    pub listen: Vec<String>,
    /// Whether peers can dial this node: `public` (a peer dialled one of its addresses back),
    /// `private` (every address tested failed: behind NAT) or `unknown` (none tested yet).
    #[serde(default)]
    pub reachability: String,
    /// This node's addresses that peers dialled back.
    #[serde(default)]
    pub external_addrs: Vec<String>,
    /// This node's addresses through relays that hold a reservation for it.
    #[serde(default)]
    pub relayed_addrs: Vec<String>,
    /// How the NAT in front of this node maps its sockets, as peers see them:
    /// `endpoint_independent` (no NAT, or a home router a hole punch gets through),
    /// `endpoint_dependent` (symmetric: no hole punch works) or `unknown`.
    #[serde(default)]
    pub nat_mapping: String,
    /// Hole punches this node took part in that made a direct connection, and that failed.
    #[serde(default)]
    pub hole_punches: u64,
    #[serde(default)]
    pub hole_punches_failed: u64,
    /// The node runs as a client (decision 0066): it cannot accept connections, exchanges
    /// only with peers it dialled, and is never elected center nor let into a ring.
    #[serde(default)]
    pub client: bool,
    pub rejected_messages: u64,
    /// Tensor bytes received in valid frames.
    pub tensor_bytes_in: u64,
    /// Of those, the bytes that came through relays (`sync.relayed_exchanges`).
    #[serde(default)]
    pub relayed_bytes_in: u64,
    pub blocked_peers: usize,
    /// Peers that went silent for the peer timeout while this node ran.
    #[serde(default)]
    pub peers_timed_out: u64,
    /// Times a peer held the staleness gate too long and was no longer waited for.
    #[serde(default)]
    pub peers_uncoupled: u64,
    /// Heartbeats ignored as no newer than the last of their peer (replays).
    #[serde(default)]
    pub heartbeats_replayed: u64,
    /// Inbound streams dropped unread because the node served as many as it serves at once
    /// (4 in all, 2 of one peer): a count that keeps rising says peers ask more than it answers.
    #[serde(default)]
    pub inbound_streams_dropped: u64,
    /// Events (heartbeats, news of connections) the network task dropped because the node did
    /// not take them in time: a count that keeps rising says the node cannot keep up.
    #[serde(default)]
    pub network_events_dropped: u64,
    pub uptime_s: f64,
    /// When the daemon started, in seconds since the Unix epoch.
    pub started_unix_s: f64,
    /// Every test evaluation so far.
    pub history: Vec<AccuracyPoint>,
    pub sync: SyncReport,
    /// The daemon's memory now, where the system says (Linux).
    #[serde(default)]
    pub memory: Option<MemoryReport>,
}

/// What the daemon's memory is made of: what the kernel counts resident, and how much of the
/// heap the daemon holds versus what the allocator keeps for reuse. A resident size that grows
/// while the heap in use does not is the allocator's, not a leak.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// Resident memory in all (`VmRSS`).
    pub resident_bytes: u64,
    /// Its anonymous part (`RssAnon`): the heap and thread stacks, not the mapped binary.
    pub anonymous_bytes: u64,
    /// Heap blocks the daemon holds (glibc's count; `None` with other allocators).
    pub heap_in_use_bytes: Option<u64>,
    /// Freed heap the allocator keeps for reuse (glibc's count).
    pub heap_free_bytes: Option<u64>,
    /// Bytes in the blocks the daemon holds, by its own exact count (`crate::allocator`);
    /// `None` from a process without that allocator.
    #[serde(default)]
    pub allocated_bytes: Option<u64>,
    /// The most resident memory the process has had (`VmHWM`).
    #[serde(default)]
    pub peak_resident_bytes: Option<u64>,
    /// The most bytes the daemon has held in its blocks, by the same exact count as
    /// `allocated_bytes`: the part of the resident peak that was the daemon's own (the rest is
    /// what the allocator kept). `None` from a process without that allocator.
    #[serde(default)]
    pub peak_allocated_bytes: Option<u64>,
}

/// The pair copies of compressed exchanges (decision 0081): two copies of the model for each
/// partner kept, within the node's `[memory]` budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairCopiesReport {
    /// The budget, in bytes.
    pub budget_bytes: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// Partners whose copies are held.
    pub partners: usize,
    /// Pairs whose copies were dropped to keep within the budget (each starts again from zero
    /// copies at its next exchange).
    pub dropped: u64,
}

/// One entry of `GET /peers`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerReport {
    pub peer_id: String,
    pub step: u64,
    pub epoch: u64,
    pub loss_ema: f32,
    pub samples_seen: u64,
    pub mode: String,
    pub role: String,
    pub last_seen_ms: u64,
    /// This node's step minus the peer's: how far the peer's replica lags behind ours
    /// (negative when it is ahead).
    #[serde(default)]
    pub staleness: i64,
    /// Round-trip time to the peer (moving average of pings), once measured.
    #[serde(default)]
    pub rtt_ms: Option<f64>,
    /// Throughput of the parameter payloads the peer sent (moving average), once measured.
    #[serde(default)]
    pub throughput_mbit_s: Option<f64>,
    /// Exchanges with the peer take several times the fastest partner's: it is offered to
    /// now and then only, and the staleness gate does not wait for it (decision 0029).
    #[serde(default)]
    pub slow_link: bool,
    /// How this node is connected to the peer: `direct`, `hole_punched` (direct, made by a
    /// hole punch through a relay) or `relayed`; none when it hears of the peer only through
    /// others.
    #[serde(default)]
    pub connection: Option<String>,
    /// The peer runs as a client: it cannot accept connections.
    #[serde(default)]
    pub client: bool,
}

/// `GET /history`: what the status page plots.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HistoryReport {
    /// The training loss, thinned to a bounded number of points over the whole run.
    pub loss: Vec<LossPoint>,
    /// Every test evaluation.
    pub accuracy: Vec<AccuracyPoint>,
}

/// The loss (moving average) at one step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossPoint {
    pub step: u64,
    pub loss: f32,
}

/// One test evaluation of the replica.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AccuracyPoint {
    /// Seconds since the Unix epoch.
    pub unix_s: f64,
    pub step: u64,
    pub test_accuracy: f64,
    #[serde(default)]
    pub test_loss: Option<f64>,
}

/// The sync part of `GET /status`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SyncReport {
    pub mode: String,
    pub role: String,
    pub interval: u64,
    /// `None`: the staleness bound is off.
    pub max_staleness: Option<u64>,
    /// Exchanges this node started that ended in a mix.
    pub exchanges: u64,
    /// Exchanges this node answered.
    pub served: u64,
    /// Partners that answered `Busy`.
    pub busy: u64,
    /// Received parameters dropped as older than the bound (elastic exchanges: a pairwise
    /// partner's are weighed by their age instead, decision 0029).
    pub stale: u64,
    /// Received parameters that failed validation.
    pub rejected: u64,
    /// Exchanges that failed on the way (peer gone, timeout).
    pub failed: u64,
    /// Tensor bytes sent (frames of every stream protocol).
    pub bytes_out: u64,
    /// Of those, the bytes sent through relays (`sync.relayed_exchanges`).
    #[serde(default)]
    pub relayed_bytes_out: u64,
    /// Time spent waiting at the staleness gate.
    pub gate_wait_s: f64,
    /// The longest single wait at the staleness gate.
    #[serde(default)]
    pub longest_gate_wait_s: f64,
    /// Time the trainer waited at a due step for the previous exchange to end.
    #[serde(default)]
    pub exchange_wait_s: f64,
    /// The longest pause between two local steps while training: at the staleness gate (a
    /// dead peer holds it until it times out) or for an exchange.
    #[serde(default)]
    pub longest_stall_s: f64,
    /// Largest lead over the slowest coupled peer with which a step was taken.
    pub max_lead: u64,
    /// Local steps between this node's snapshots now: `interval`, or more where
    /// `adapt_interval` stretched it to the exchanges' pauses.
    #[serde(default)]
    pub current_interval: u64,
    /// Mixes and elastic deltas applied to this replica.
    #[serde(default)]
    pub merges: u64,
    /// Exchanges (started or answered) mixed through the sparse codec of a slow link
    /// (`sync.adapt_codec`).
    #[serde(default)]
    pub sparse_exchanges: u64,
    /// Received parameters or elastic deltas moved within the clip radius before the mix.
    #[serde(default)]
    pub clipped: u64,
    /// Their lags summed: local steps between each snapshot and its mix (`sync.overlap`).
    #[serde(default)]
    pub merge_lag_steps: u64,
    /// The largest lag of a mix, at most `sync.max_merge_lag`.
    #[serde(default)]
    pub max_merge_lag: u64,
    pub state_syncs: u64,
    /// State syncs that went on from where a transfer cut off had stopped (decision 0083).
    #[serde(default)]
    pub state_syncs_resumed: u64,
    /// Tensor bytes received while taking over peers' states, whether taken or not.
    #[serde(default)]
    pub state_bytes_received: u64,
    /// What the pair copies of compressed exchanges hold, against their budget (`[memory]`).
    #[serde(default)]
    pub pair_copies: PairCopiesReport,
    /// The elastic center, as this node sees it.
    pub center: Option<String>,
    pub center_version: u64,
}
