//! The node's counters, each declared once, in the table of [`counts!`]: what it counts, its
//! unit, its name and label in `/metrics` and its help. The exporters (`/metrics` and
//! OpenTelemetry, both built by [`crate::metrics::readings`]) go through the table, so a new
//! counter is one line here, plus a field of the status report if `nodectl status` is to show it.
//!
//! Besides the counters, the node keeps a few peaks (the longest wait, the largest lead), which
//! are gauges: they only grow, but they are not sums.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What a counter adds up, and so how an exporter reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// One per event.
    Events,
    /// Bytes of tensor payloads.
    Bytes,
    /// Local training steps.
    Steps,
    /// Time, kept in microseconds and reported in seconds.
    Seconds,
}

/// How a counter is reported: `murmur_<name>{<label>}` with its help.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CountMetric {
    /// Without the `murmur_` prefix; ends in `_total`.
    pub name: &'static str,
    /// At most one label: counters of one name tell apart by it (an exchange's outcome).
    pub label: Option<(&'static str, &'static str)>,
    pub unit: Unit,
    pub help: &'static str,
}

/// Declares [`Count`] from one table: a row per counter, as
/// `Variant: Unit, "metric_name_total" ["label" = "value"], "help";`. Rows of one metric name
/// stay adjacent, as exporters want them.
macro_rules! counts {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident: $unit:ident, $name:literal $([$key:literal = $value:literal])?, $help:expr;
    )*) => {
        /// Everything a node counts, for `GET /status`, `/metrics` and OpenTelemetry.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Count {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Count {
            /// Every counter, in the order `/metrics` lists them.
            pub const ALL: [Count; [$(Count::$variant),*].len()] = [$(Count::$variant),*];

            /// How exporters report it.
            pub fn metric(self) -> CountMetric {
                match self {
                    $(Count::$variant => CountMetric {
                        name: $name,
                        label: counts!(@label $($key, $value)?),
                        unit: Unit::$unit,
                        help: $help,
                    },)*
                }
            }
        }
    };
    (@label) => { None };
    (@label $key:literal, $value:literal) => { Some(($key, $value)) };
}

const EXCHANGES: &str = "Parameter exchanges this node started, by outcome";

counts! {
    /// An exchange this node started ended in a mix (or a ring round completed).
    Exchange: Events, "exchanges_total" ["outcome" = "ok"], EXCHANGES;
    /// A partner answered `Busy`.
    Busy: Events, "exchanges_total" ["outcome" = "busy"], EXCHANGES;
    /// Received parameters were too stale to mix.
    Stale: Events, "exchanges_total" ["outcome" = "stale"], EXCHANGES;
    /// Received parameters failed validation.
    Rejected: Events, "exchanges_total" ["outcome" = "rejected"], EXCHANGES;
    /// An exchange failed on the way (peer gone, timeout).
    Failed: Events, "exchanges_total" ["outcome" = "failed"], EXCHANGES;
    /// An exchange this node answered ended in a mix.
    Served: Events, "exchanges_served_total", "Parameter exchanges this node answered";
    /// Tensor bytes received in valid frames.
    BytesReceived: Bytes, "received_bytes_total", "Tensor bytes received in valid frames";
    /// Tensor bytes sent, in frames of every stream protocol and ring data.
    BytesSent: Bytes, "sent_bytes_total", "Tensor bytes sent";
    /// Of the tensor bytes received, those received through a relay.
    RelayedBytesReceived: Bytes, "relayed_received_bytes_total",
        "Tensor bytes received through relays (sync.relayed_exchanges)";
    /// Of the tensor bytes sent, those sent through a relay (`sync.relayed_exchanges`).
    RelayedBytesSent: Bytes, "relayed_sent_bytes_total",
        "Tensor bytes sent through relays (sync.relayed_exchanges)";
    /// Time the trainer waited at the staleness gate.
    GateWait: Seconds, "staleness_gate_wait_seconds_total",
        "Time the trainer waited at the staleness gate";
    /// Time the trainer waited at a due step for the previous exchange to end.
    ExchangeWait: Seconds, "exchange_wait_seconds_total",
        "Time the trainer waited for the previous exchange at a due step";
    /// An exchange (started or answered) mixed through the sparse codec of a slow link
    /// (`sync.adapt_codec`).
    Sparse: Events, "sparse_exchanges_total",
        "Exchanges mixed through the sparse codec of a slow link (sync.adapt_codec)";
    /// Received parameters (or an elastic delta) lay past the clip radius and were moved
    /// within it before the mix (decision 0041).
    Clipped: Events, "clipped_mixes_total",
        "Received parameters or deltas moved within the clip radius before the mix";
    /// A mix or an elastic delta was applied to this replica.
    Merge: Events, "merges_total", "Mixes and elastic deltas applied to this replica";
    /// Local steps between a merged snapshot and its mix (non-zero with `sync.overlap`).
    MergeLag: Steps, "merge_lag_steps_total",
        "Local steps between each merged snapshot and its mix, summed";
    /// This replica took over a peer's state.
    StateSync: Events, "state_syncs_total", "Full state transfers from a peer";
    /// A state sync went on from where one cut off had stopped (decision 0083).
    StateSyncResumed: Events, "state_syncs_resumed_total",
        "State syncs that went on from where a transfer cut off had stopped";
    /// Tensor bytes received while taking over states, whether or not the state was taken.
    StateBytesReceived: Bytes, "state_received_bytes_total",
        "Tensor bytes received while taking over peers' states";
    /// A message from a peer was refused (scored against the peer).
    RejectedMessage: Events, "rejected_messages_total",
        "Messages from peers refused by validation";
    /// A peer went silent for the peer timeout.
    PeerTimedOut: Events, "peers_timed_out_total", "Peers that went silent for the peer timeout";
    /// A peer held the staleness gate past its patience and is not waited for (decision 0039).
    PeerUncoupled: Events, "peers_uncoupled_total",
        "Times a peer held the staleness gate too long and was no longer waited for";
    /// A peer's heartbeat was no newer than the last taken from it (a replay, decision 0040)
    /// and was ignored.
    HeartbeatReplayed: Events, "heartbeats_replayed_total",
        "Heartbeats ignored as no newer than the last of their peer (replays)";
    /// An inbound stream was dropped unread: the node served as many as it serves at once, in
    /// all or of that peer (`murmur_sync::sides`).
    InboundDropped: Events, "inbound_streams_dropped_total",
        "Inbound streams dropped unread because the node served as many as it serves at once";
}

/// The node's counters and peaks: written by its actors, read by observers.
#[derive(Debug, Default)]
pub struct Counters {
    counts: [AtomicU64; Count::ALL.len()],
    longest_gate_wait_us: AtomicU64,
    longest_stall_us: AtomicU64,
    max_lead: AtomicU64,
    max_merge_lag: AtomicU64,
}

impl Counters {
    /// One more event.
    pub fn count(&self, what: Count) {
        self.add(what, 1);
    }

    /// `amount` more, in the counter's unit (microseconds for [`Unit::Seconds`]).
    pub fn add(&self, what: Count, amount: u64) {
        self.counts[what as usize].fetch_add(amount, Ordering::Relaxed);
    }

    /// The raw count (microseconds for [`Unit::Seconds`]).
    pub fn get(&self, what: Count) -> u64 {
        self.counts[what as usize].load(Ordering::Relaxed)
    }

    /// The count as exporters report it: seconds for a time, the count otherwise.
    pub fn value(&self, what: Count) -> f64 {
        let raw = self.get(what) as f64;
        match what.metric().unit {
            Unit::Seconds => raw / 1e6,
            Unit::Events | Unit::Bytes | Unit::Steps => raw,
        }
    }

    /// One wait at the staleness gate: counted in the total and in the longest.
    pub fn gate_wait(&self, waited: Duration) {
        let us = waited.as_micros() as u64;
        self.add(Count::GateWait, us);
        self.longest_gate_wait_us.fetch_max(us, Ordering::Relaxed);
    }

    /// A wait at a due step for the previous exchange to end.
    pub fn exchange_wait(&self, waited: Duration) {
        self.add(Count::ExchangeWait, waited.as_micros() as u64);
    }

    /// A pause between two local steps.
    pub fn stall(&self, stalled: Duration) {
        self.longest_stall_us
            .fetch_max(stalled.as_micros() as u64, Ordering::Relaxed);
    }

    /// The lead over the slowest coupled peer with which a step was taken.
    pub fn lead(&self, lead: u64) {
        self.max_lead.fetch_max(lead, Ordering::Relaxed);
    }

    /// A mix (or elastic delta) applied `lag` local steps after the snapshot it was computed
    /// from: zero unless the trainer trains through its exchanges (`sync.overlap`).
    pub fn merged(&self, lag: u64) {
        self.count(Count::Merge);
        self.add(Count::MergeLag, lag);
        self.max_merge_lag.fetch_max(lag, Ordering::Relaxed);
    }

    /// The longest single wait at the staleness gate, in seconds.
    pub fn longest_gate_wait_s(&self) -> f64 {
        self.longest_gate_wait_us.load(Ordering::Relaxed) as f64 / 1e6
    }

    /// The longest pause between two local steps, in seconds.
    pub fn longest_stall_s(&self) -> f64 {
        self.longest_stall_us.load(Ordering::Relaxed) as f64 / 1e6
    }

    pub fn max_lead(&self) -> u64 {
        self.max_lead.load(Ordering::Relaxed)
    }

    pub fn max_merge_lag(&self) -> u64 {
        self.max_merge_lag.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_counter_has_its_own_cell_and_a_metric_name_ending_in_total() {
        let counters = Counters::default();
        for (i, &what) in Count::ALL.iter().enumerate() {
            assert_eq!(what as usize, i, "{what:?} is out of place in Count::ALL");
            counters.add(what, i as u64 + 1);
            assert!(what.metric().name.ends_with("_total"), "{what:?}");
        }
        for (i, &what) in Count::ALL.iter().enumerate() {
            assert_eq!(counters.get(what), i as u64 + 1, "{what:?}");
        }
    }

    #[test]
    fn gate_waits_add_up_in_seconds_and_the_longest_is_kept() {
        let counters = Counters::default();
        for ms in [30, 500, 20] {
            counters.gate_wait(Duration::from_millis(ms));
        }
        assert_eq!(counters.get(Count::GateWait), 550_000);
        assert!((counters.value(Count::GateWait) - 0.55).abs() < 1e-9);
        assert!((counters.longest_gate_wait_s() - 0.5).abs() < 1e-9);
        counters.add(Count::BytesSent, 7);
        assert_eq!(counters.value(Count::BytesSent), 7.0);
    }

    #[test]
    fn names_with_more_than_one_counter_tell_them_apart_by_one_label_and_are_adjacent() {
        let mut seen: Vec<&str> = Vec::new();
        for what in Count::ALL {
            let metric = what.metric();
            if seen.last() == Some(&metric.name) {
                assert!(
                    metric.label.is_some(),
                    "{what:?} shares its name without a label"
                );
                continue;
            }
            assert!(
                !seen.contains(&metric.name),
                "{} is split around other counters",
                metric.name
            );
            seen.push(metric.name);
        }
    }
}
