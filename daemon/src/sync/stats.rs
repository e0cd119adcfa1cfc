//! Counters of the sync engine and the staleness gate, and their `GET /status` report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use murmur_protocol::heartbeat::Role;
use murmur_protocol::network::PeerId;
use serde::{Deserialize, Serialize};

use super::SyncSettings;

/// Counters of the sync engine and the staleness gate, read by `GET /status`.
#[derive(Debug, Default)]
pub struct SyncStats {
    pub(super) exchanges: AtomicU64,
    pub(super) served: AtomicU64,
    pub(super) busy: AtomicU64,
    pub(super) stale: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) bytes_out: AtomicU64,
    pub(super) gate_wait_us: AtomicU64,
    pub(super) exchange_wait_us: AtomicU64,
    pub(super) longest_stall_us: AtomicU64,
    pub(super) max_lead: AtomicU64,
    pub(super) state_syncs: AtomicU64,
    pub(super) center_version: AtomicU64,
    /// Latencies, for `/metrics`.
    pub(crate) timings: crate::metrics::Timings,
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
    /// Received parameters dropped as older than the bound.
    pub stale: u64,
    /// Received parameters that failed validation.
    pub rejected: u64,
    /// Exchanges that failed on the way (peer gone, timeout).
    pub failed: u64,
    /// Tensor bytes sent (frames of every stream protocol).
    pub bytes_out: u64,
    /// Time spent waiting at the staleness gate.
    pub gate_wait_s: f64,
    /// Time the trainer waited at a due step for the previous exchange to end.
    #[serde(default)]
    pub exchange_wait_s: f64,
    /// The longest pause between two local steps while training: at the staleness gate (a
    /// dead peer holds it until it times out) or for an exchange.
    #[serde(default)]
    pub longest_stall_s: f64,
    /// Largest lead over the slowest coupled peer with which a step was taken.
    pub max_lead: u64,
    pub state_syncs: u64,
    /// The elastic center, as this node sees it.
    pub center: Option<String>,
    pub center_version: u64,
}

impl SyncStats {
    pub fn add_gate_wait(&self, waited: Duration) {
        self.gate_wait_us
            .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn add_exchange_wait(&self, waited: Duration) {
        self.exchange_wait_us
            .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn observe_stall(&self, stalled: Duration) {
        self.longest_stall_us
            .fetch_max(stalled.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn observe_lead(&self, lead: u64) {
        self.max_lead.fetch_max(lead, Ordering::Relaxed);
    }

    pub(super) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn report(
        &self,
        settings: &SyncSettings,
        role: Role,
        center: Option<PeerId>,
    ) -> SyncReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SyncReport {
            mode: format!("{:?}", settings.mode).to_lowercase(),
            role: format!("{role:?}").to_lowercase(),
            interval: settings.interval,
            max_staleness: settings.max_staleness,
            exchanges: get(&self.exchanges),
            served: get(&self.served),
            busy: get(&self.busy),
            stale: get(&self.stale),
            rejected: get(&self.rejected),
            failed: get(&self.failed),
            bytes_out: get(&self.bytes_out),
            gate_wait_s: get(&self.gate_wait_us) as f64 / 1e6,
            exchange_wait_s: get(&self.exchange_wait_us) as f64 / 1e6,
            longest_stall_s: get(&self.longest_stall_us) as f64 / 1e6,
            max_lead: get(&self.max_lead),
            state_syncs: get(&self.state_syncs),
            center: center.map(|c| c.to_string()),
            center_version: get(&self.center_version),
        }
    }
}
