//! What a running node works from, resolved from the run config, the node config and the flags:
//! who it is ([`Identity`]), how it syncs ([`SyncSettings`], [`RingSettings`]) and every bound
//! on a wait ([`Timeouts`], the timeout hierarchy of docs/operations.md). Plain data: nothing
//! here does I/O.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use murmur_protocol::codec::Codec;
use murmur_protocol::heartbeat::SyncMode;
use murmur_protocol::network::{NetworkConfig, PeerId};
use murmur_protocol::ring::DataPlane;
use murmur_protocol::trust::TrustList;

use crate::config::{
    ClientMode, CodecName, ElasticTopology, Election, NodeConfig, OuterOptimizer, RunConfig,
    SyncModeName,
};
use crate::store::DataDir;

/// Everything a node runs with, resolved: who it is, how it syncs, its bounds, its network,
/// where its control API listens and where it keeps its state.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub identity: Identity,
    pub sync: SyncSettings,
    pub timeouts: Timeouts,
    pub network: NetworkConfig,
    /// Control API address (loopback only).
    pub api_addr: String,
    pub data: DataDir,
    /// Whether the node runs as a client, one that cannot accept connections.
    pub client: ClientMode,
}

/// What a node is: who it is, and which run and model it trains.
#[derive(Clone, Debug)]
pub struct Identity {
    pub peer_id: PeerId,
    pub run_id: String,
    pub fingerprint: String,
    pub model: String,
    /// The device the replica trains on, as its backend names it.
    pub device: String,
    pub epochs: u64,
    /// Values in the model's flat parameter buffer.
    pub param_count: usize,
    /// The names of the replica's optimizer state buffers: a state sync hands them over
    /// between peers that keep the same.
    pub optimizer_buffers: Vec<String>,
}

impl Identity {
    /// Bytes in one flat parameter buffer: the largest tensor a peer may send.
    pub fn param_bytes(&self) -> u64 {
        self.param_count as u64 * std::mem::size_of::<f32>() as u64
    }
}

/// The `[sync]` settings of a run, resolved for this node.
#[derive(Clone, Debug)]
pub struct SyncSettings {
    pub mode: SyncMode,
    /// Local steps between exchanges (`allreduce.every` in `allreduce` mode).
    pub interval: u64,
    pub max_staleness: Option<u64>,
    pub age_weighting: bool,
    /// Train on while this replica's exchanges are in flight.
    pub overlap: bool,
    /// With `overlap`: the most steps a mix may land after its snapshot.
    pub max_merge_lag: u64,
    /// Stretch the interval to the exchanges' pauses (not in `allreduce`).
    pub adapt_interval: bool,
    /// Gossip and elastic: the outer step on each replica's progress between mixes.
    pub outer: Outer,
    /// The codec of pairwise exchanges; anything but `F32` sends differences against the
    /// pair's copies.
    pub codec: Codec,
    /// With `sync.adapt_codec`: the codec of exchanges with partners on slow links.
    pub sparse_codec: Option<Codec>,
    pub slowdown: f64,
    pub alpha: Option<f32>,
    pub topology: ElasticTopology,
    /// A configured elastic center.
    pub center: Option<PeerId>,
    /// Who else stands for the elastic center's election: trusted peers, or anyone.
    pub election: Election,
    /// Parameters and state may cross connections through relays (`sync.relayed_exchanges`);
    /// by default only direct ones carry them.
    pub relayed_exchanges: bool,
    /// The node's trusted peers (`[trust] peers`): the only ones it lets into rings (and takes
    /// a ring's state from) and, unless the election is open, the only ones (with itself and
    /// the pinned center) it elects as elastic center.
    pub trust: TrustList,
    /// Run seed: with the peer id, seeds partner choice.
    pub seed: u64,
    /// `allreduce` mode: the ring settings.
    pub ring: Option<RingSettings>,
}

impl SyncSettings {
    /// The `[sync]` section of `config` with the node's trust.
    pub fn resolve(config: &RunConfig, node: &NodeConfig) -> Result<Self> {
        let s = &config.sync;
        let trust = TrustList::new(node.trust.peer_ids()?);
        let center = s
            .elastic
            .center
            .as_deref()
            .map(|id| {
                id.parse().with_context(|| {
                    format!("sync.elastic.center `{id}` is not a peer id (see `nodectl id`)")
                })
            })
            .transpose()?;
        let e = &s.elastic;
        if s.mode == SyncModeName::Elastic
            && e.topology == ElasticTopology::Center
            && e.election == Election::Trusted
            && center.is_none()
            && trust.is_empty()
        {
            bail!(
                "sync.mode = \"elastic\" elects its center among the peers this node trusts, and \
                 [trust] peers in the node config is empty (a stranger could otherwise make an \
                 identity that wins the election and steer every replica): add the peers you \
                 run with `nodectl trust add <peer-id>` (`nodectl id` prints a node's peer id), \
                 or pin the center with sync.elastic.center, or set sync.elastic.election = \
                 \"open\" if every peer that can reach this run is yours"
            );
        }
        Ok(SyncSettings {
            mode: match s.mode {
                SyncModeName::Solo => SyncMode::Solo,
                SyncModeName::Gossip => SyncMode::Gossip,
                SyncModeName::Elastic => SyncMode::Elastic,
                SyncModeName::Allreduce => SyncMode::Allreduce,
            },
            // In allreduce mode the trainer hands over every `allreduce.every` steps.
            interval: if s.mode == SyncModeName::Allreduce {
                s.allreduce.every
            } else {
                s.interval
            },
            max_staleness: s.max_staleness,
            age_weighting: s.age_weighting,
            overlap: s.overlap,
            max_merge_lag: s.max_merge_lag,
            adapt_interval: s.adapt_interval && s.mode != SyncModeName::Allreduce,
            outer: Outer::resolve(s.outer, s.outer_lr, s.outer_momentum),
            codec: match s.codec {
                CodecName::F32 => Codec::F32,
                CodecName::Bf16 => Codec::Bf16,
                CodecName::Int8 => Codec::INT8,
                CodecName::Int4 => Codec::INT4,
                CodecName::Topk => Codec::TOP_K,
            },
            sparse_codec: s.adapt_codec.then_some(Codec::TOP_K),
            slowdown: s.slowdown,
            alpha: s.elastic.alpha,
            topology: s.elastic.topology,
            center,
            election: e.election,
            relayed_exchanges: s.relayed_exchanges,
            seed: config.run.seed,
            ring: RingSettings::resolve(config, node, &trust)?,
            trust,
        })
    }

    /// Whether this node exchanges compressed differences through `codec` when a partner's
    /// offer asks for it: its own codec, or its sparse one.
    pub fn takes(&self, codec: Codec) -> bool {
        codec != Codec::F32 && (codec == self.codec || Some(codec) == self.sparse_codec)
    }

    /// Exchanges are pairwise (gossip, or elastic gossip).
    pub fn pairwise(&self) -> bool {
        self.mode == SyncMode::Gossip
            || (self.mode == SyncMode::Elastic && self.topology == ElasticTopology::Gossip)
    }

    /// One peer holds a center variable (elastic with the default topology).
    pub fn centered(&self) -> bool {
        self.mode == SyncMode::Elastic && self.topology == ElasticTopology::Center
    }

    /// The elastic `alpha` for `p` live peers (this one included): configured, else `0.9 / p`.
    pub fn alpha(&self, p: usize) -> f32 {
        self.alpha.unwrap_or(0.9 / p.max(1) as f32)
    }

    /// The weight of a pairwise mix before age weighting.
    pub fn pair_weight(&self, p: usize) -> f32 {
        if self.mode == SyncMode::Elastic {
            self.alpha(p)
        } else {
            0.5
        }
    }

    /// The bound on the age of mixed parameters, in steps apart: `max_staleness`, and with
    /// `overlap` also `max_merge_lag`, since a snapshot in flight ages while its trainer
    /// trains on (decision 0021). Past it, elastic exchanges are not mixed (at the center, or
    /// as a worker's delta), and a pairwise partner's parameters count the less the older they
    /// are (decision 0029).
    pub fn mix_bound(&self) -> Option<u64> {
        let lag = if self.overlap { self.max_merge_lag } else { 0 };
        self.max_staleness.map(|bound| bound + lag)
    }

    /// `allreduce` with `every = 1`: the trainer hands over gradients, not parameters.
    pub fn averages_gradients(&self) -> bool {
        self.ring
            .as_ref()
            .is_some_and(RingSettings::averages_gradients)
    }
}

/// What follows a parameter average.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outer {
    /// Continue from the average.
    Average,
    /// The DiLoCo outer Nesterov step.
    Nesterov { lr: f32, momentum: f32 },
}

impl Outer {
    fn resolve(outer: OuterOptimizer, lr: f32, momentum: f32) -> Self {
        match outer {
            OuterOptimizer::None => Outer::Average,
            OuterOptimizer::Nesterov => Outer::Nesterov { lr, momentum },
        }
    }
}

/// The `[sync.allreduce]` settings, resolved.
#[derive(Clone, Debug)]
pub struct RingSettings {
    /// `1`: gradients every step; `H`: parameters every `H` steps.
    pub every: u64,
    pub outer: Outer,
    pub plane: DataPlane,
    /// Longest one attempt at a round may take.
    pub timeout: Duration,
    /// Members (this node included) the first round waits for.
    pub min_peers: usize,
    /// Values per sub-chunk.
    pub sub_chunk: usize,
    /// Where the TCP data plane listens.
    pub listen: SocketAddr,
}

impl RingSettings {
    /// The `[sync.allreduce]` section (which needs a trust list); `None` in other modes.
    fn resolve(config: &RunConfig, node: &NodeConfig, trust: &TrustList) -> Result<Option<Self>> {
        if config.sync.mode != SyncModeName::Allreduce {
            return Ok(None);
        }
        if trust.is_empty() {
            bail!(
                "sync.mode = \"allreduce\" runs only among trusted peers, and [trust] peers in \
                 the node config is empty: add every peer of the ring with `nodectl trust add \
                 <peer-id>` (`nodectl id` prints a node's peer id)"
            );
        }
        let a = &config.sync.allreduce;
        let listen = node.ring_listen.parse().with_context(|| {
            format!(
                "ring_listen `{}` in the node config is not an address like 10.0.0.5:7100",
                node.ring_listen
            )
        })?;
        Ok(Some(RingSettings {
            every: a.every,
            outer: Outer::resolve(a.outer, a.outer_lr, a.outer_momentum),
            plane: a.plane,
            timeout: Duration::from_secs_f64(a.ring_timeout),
            min_peers: a.min_peers,
            sub_chunk: a.sub_chunk_kb * 1024 / 4,
            listen,
        }))
    }

    /// Whether the trainer hands over gradients (synchronous SGD) rather than parameters.
    pub fn averages_gradients(&self) -> bool {
        self.every == 1
    }
}

/// How often a node publishes its heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// Every bound on a wait in a running node, in one place. They nest (docs/operations.md, "The
/// timeout hierarchy"): a layer gives up only after the layer below it has had time to notice
/// a failure itself, so a failure is reported once, by the layer that owns it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timeouts {
    /// How often a node publishes its heartbeat; the engine's maintenance tick.
    pub heartbeat: Duration,
    /// A peer not heard from for this long is gone (`--peer-timeout-secs`).
    pub peer: Duration,
    /// One exchange or state sync, all its frames.
    pub exchange: Duration,
    /// The header of the frame that opens an inbound stream: a peer writes it as the stream
    /// opens, so a stream silent for this long is held open on purpose (or by a dead peer),
    /// and is let go well before the exchange timeout.
    pub request: Duration,
    /// The replica driver's answer to a request (a snapshot, its state): one step, normally.
    pub replica_answer: Duration,
    /// How long a peer that answered `Busy` is left alone: about one exchange of the default
    /// MLP on loopback (~12 ms), so that it is asked again as soon as it is likely to be free.
    pub busy_backoff: Duration,
    /// How long a peer whose exchange failed (gone, timed out, reset) is left alone.
    pub failure_backoff: Duration,
    /// After an aborted ring round: how long a member may stay silent before the next attempts
    /// leave it out (one and a half heartbeat periods: a live member is heard at least once).
    pub ring_settle: Duration,
    /// How long a starting `allreduce` node listens for peers before it takes itself for the
    /// first of its run (two heartbeat periods: a running peer is heard within one).
    pub first_peer_grace: Duration,
    /// At shutdown: how long each part of the node may take to finish (the engine's last
    /// exchanges, the trainer's checkpoint, the goodbye heartbeat).
    pub drain: Duration,
}

impl Timeouts {
    /// The hierarchy around a peer timeout of `peer`.
    pub fn new(peer: Duration) -> Self {
        let heartbeat = HEARTBEAT_INTERVAL;
        Timeouts {
            heartbeat,
            peer,
            exchange: Duration::from_secs(30),
            request: Duration::from_secs(10),
            replica_answer: Duration::from_secs(30),
            busy_backoff: Duration::from_millis(20),
            failure_backoff: Duration::from_secs(1),
            ring_settle: heartbeat.mul_f64(1.5),
            first_peer_grace: heartbeat * 2,
            drain: Duration::from_secs(10),
        }
    }
}

impl Default for Timeouts {
    /// The defaults of `nodectl join` (a 10 s peer timeout).
    fn default() -> Self {
        Timeouts::new(Duration::from_secs(10))
    }
}
