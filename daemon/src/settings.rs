//! What a running node works from, resolved from the run config, the node config and the flags:
//! who it is ([`Identity`]) and how it syncs ([`resolve_sync`] makes the sync crate's
//! [`SyncSettings`] of the `[sync]` section). Plain data: nothing here does I/O.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use murmur_protocol::codec::Codec;
use murmur_protocol::network::{NetworkConfig, PeerId};
use murmur_protocol::trust::TrustList;
use murmur_sync::settings::{
    ElasticSettings, ElasticTopology, Election, Mode, Outer, RingSettings, SyncSettings, Timeouts,
};

use crate::config::{ClientMode, CodecName, NodeConfig, OuterOptimizer, RunConfig, SyncModeName};
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
    /// Bytes the pair copies of compressed exchanges may hold (`[memory]`).
    pub pair_copies_budget: u64,
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

/// The `[sync]` section of `config`, with the node's trust: the settings the sync engine and
/// the replica loop work from.
pub fn resolve_sync(config: &RunConfig, node: &NodeConfig) -> Result<SyncSettings> {
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
            SyncModeName::Solo => Mode::Solo,
            SyncModeName::Gossip => Mode::Gossip,
            SyncModeName::Elastic => Mode::Elastic(ElasticSettings {
                alpha: e.alpha,
                topology: e.topology,
                center,
                election: e.election,
            }),
            SyncModeName::Allreduce => Mode::Allreduce(resolve_ring(config, node, &trust)?),
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
        adapt_interval: s.adapt_interval,
        outer: resolve_outer(s.outer, s.outer_lr, s.outer_momentum),
        codec: match s.codec {
            CodecName::F32 => Codec::F32,
            CodecName::Bf16 => Codec::Bf16,
            CodecName::Int8 => Codec::INT8,
            CodecName::Int4 => Codec::INT4,
            CodecName::Topk => Codec::TOP_K,
        },
        sparse_codec: s.adapt_codec.then_some(Codec::TOP_K),
        slowdown: s.slowdown,
        relayed_exchanges: s.relayed_exchanges,
        seed: config.run.seed,
        trust,
    })
}

/// What follows a parameter average, as the config names it.
fn resolve_outer(outer: OuterOptimizer, lr: f32, momentum: f32) -> Outer {
    match outer {
        OuterOptimizer::None => Outer::Average,
        OuterOptimizer::Nesterov => Outer::Nesterov { lr, momentum },
    }
}

/// The `[sync.allreduce]` section of an `allreduce` run, which needs a trust list.
fn resolve_ring(config: &RunConfig, node: &NodeConfig, trust: &TrustList) -> Result<RingSettings> {
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
    Ok(RingSettings {
        every: a.every,
        outer: resolve_outer(a.outer, a.outer_lr, a.outer_momentum),
        plane: a.plane,
        timeout: Duration::from_secs_f64(a.ring_timeout),
        min_peers: a.min_peers,
        sub_chunk: a.sub_chunk_kb * 1024 / 4,
        listen,
    })
}
