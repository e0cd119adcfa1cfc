//! How a node syncs, resolved from its run's `[sync]` section ([`SyncSettings`],
//! [`RingSettings`]), and every bound on a wait ([`Timeouts`], the timeout hierarchy of
//! docs/operations.md). Plain data: the daemon resolves it from the config files.

use std::net::SocketAddr;
use std::time::Duration;

use libp2p_identity::PeerId;
use murmur_protocol::codec::Codec;
use murmur_protocol::heartbeat::SyncMode;
use murmur_protocol::ring::DataPlane;
use murmur_protocol::trust::TrustList;
use serde::{Deserialize, Serialize};

/// The `[sync]` settings of a run, resolved for this node.
#[derive(Clone, Debug)]
pub struct SyncSettings {
    /// The mode, with the settings that only it has.
    pub mode: Mode,
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
    /// Parameters and state may cross connections through relays (`sync.relayed_exchanges`);
    /// by default only direct ones carry them.
    pub relayed_exchanges: bool,
    /// The node's trusted peers (`[trust] peers`): the only ones it lets into rings (and takes
    /// a ring's state from) and, unless the election is open, the only ones (with itself and
    /// the pinned center) it elects as elastic center.
    pub trust: TrustList,
    /// Run seed: with the peer id, seeds partner choice.
    pub seed: u64,
}

/// How a node syncs, each mode with the settings that it alone has: an elastic center or a
/// ring cannot be configured for a mode that has none.
#[derive(Clone, Debug)]
pub enum Mode {
    /// Trains alone.
    Solo,
    /// Pairwise exchanges with partners chosen at random.
    Gossip,
    /// Elastic averaging (EASGD), around a center or pairwise.
    Elastic(ElasticSettings),
    /// Ring all-reduce among trusted peers.
    Allreduce(RingSettings),
}

impl Mode {
    /// The mode's name, as heartbeats carry it.
    pub fn name(&self) -> SyncMode {
        match self {
            Mode::Solo => SyncMode::Solo,
            Mode::Gossip => SyncMode::Gossip,
            Mode::Elastic(_) => SyncMode::Elastic,
            Mode::Allreduce(_) => SyncMode::Allreduce,
        }
    }

    /// The elastic settings, in `elastic` mode.
    pub fn elastic(&self) -> Option<&ElasticSettings> {
        match self {
            Mode::Elastic(elastic) => Some(elastic),
            _ => None,
        }
    }

    /// The ring settings, in `allreduce` mode.
    pub fn ring(&self) -> Option<&RingSettings> {
        match self {
            Mode::Allreduce(ring) => Some(ring),
            _ => None,
        }
    }
}

/// The `[sync.elastic]` settings, resolved.
#[derive(Clone, Debug, Default)]
pub struct ElasticSettings {
    /// The mixing weight; `None`: `0.9 / p` for `p` live peers.
    pub alpha: Option<f32>,
    pub topology: ElasticTopology,
    /// A configured center.
    pub center: Option<PeerId>,
    /// Who else stands for the center's election: trusted peers, or anyone.
    pub election: Election,
}

impl SyncSettings {
    /// Whether this node exchanges compressed differences through `codec` when a partner's
    /// offer asks for it: its own codec, or its sparse one.
    pub fn takes(&self, codec: Codec) -> bool {
        codec != Codec::F32 && (codec == self.codec || Some(codec) == self.sparse_codec)
    }

    /// Exchanges are pairwise (gossip, or elastic gossip).
    pub fn pairwise(&self) -> bool {
        match &self.mode {
            Mode::Gossip => true,
            Mode::Elastic(elastic) => elastic.topology == ElasticTopology::Gossip,
            Mode::Solo | Mode::Allreduce(_) => false,
        }
    }

    /// One peer holds a center variable (elastic with the default topology).
    pub fn centered(&self) -> bool {
        self.mode
            .elastic()
            .is_some_and(|elastic| elastic.topology == ElasticTopology::Center)
    }

    /// The elastic `alpha` for `p` live peers (this one included): configured, else `0.9 / p`.
    pub fn alpha(&self, p: usize) -> f32 {
        let configured = self.mode.elastic().and_then(|elastic| elastic.alpha);
        configured.unwrap_or(0.9 / p.max(1) as f32)
    }

    /// The weight of a pairwise mix before age weighting.
    pub fn pair_weight(&self, p: usize) -> f32 {
        match self.mode {
            Mode::Elastic(_) => self.alpha(p),
            _ => 0.5,
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
        self.mode
            .ring()
            .is_some_and(RingSettings::averages_gradients)
    }
}

#[cfg(test)]
impl SyncSettings {
    /// Settings for the crate's tests: `mode`, an interval of 8, a
    /// staleness bound of 16, no age weighting, overlap, outer step or codec, an elastic
    /// center by open election, seed 7.
    pub(crate) fn for_tests(mode: SyncMode) -> Self {
        let mode = match mode {
            SyncMode::Solo => Mode::Solo,
            SyncMode::Gossip => Mode::Gossip,
            SyncMode::Elastic => Mode::Elastic(ElasticSettings {
                election: Election::Open,
                ..ElasticSettings::default()
            }),
            SyncMode::Allreduce => Mode::Allreduce(RingSettings::for_tests()),
        };
        SyncSettings {
            mode,
            interval: 8,
            max_staleness: Some(16),
            age_weighting: false,
            overlap: false,
            max_merge_lag: 256,
            adapt_interval: false,
            outer: Outer::Average,
            codec: Codec::F32,
            sparse_codec: None,
            slowdown: 1.0,
            relayed_exchanges: false,
            seed: 7,
            trust: TrustList::default(),
        }
    }
}

#[cfg(test)]
impl RingSettings {
    /// Ring settings for the crate's tests: gradients every step on libp2p, a 5 s timeout, one
    /// member enough.
    pub(crate) fn for_tests() -> Self {
        RingSettings {
            every: 1,
            outer: Outer::Average,
            plane: DataPlane::Libp2p,
            timeout: Duration::from_secs(5),
            min_peers: 1,
            sub_chunk: 1024,
            listen: "127.0.0.1:0".parse().expect("invariant: an address"),
        }
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
    /// One exchange, all its frames; a state sync's every chunk.
    pub exchange: Duration,
    /// One state sync, all its chunks (a large state on a slow link takes minutes; one that
    /// is cut off goes on where it stopped, decision 0083).
    pub state_sync: Duration,
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
            state_sync: Duration::from_secs(600),
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

/// `sync.elastic.election`: whom a node may elect as its elastic center (decision 0052).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Election {
    /// The peers of the node's trust list and the node itself: a stranger never holds the
    /// center. A node with no trust list and no pinned center cannot start.
    #[default]
    Trusted,
    /// Every live peer of the run: anyone who can reach it can mint an identity that wins.
    Open,
}

/// `sync.elastic.topology`: whether one elected peer holds the center variable, or elastic
/// exchanges are pairwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ElasticTopology {
    #[default]
    Center,
    Gossip,
}
