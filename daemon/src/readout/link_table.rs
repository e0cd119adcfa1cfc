//! What this node knows of the link to each peer: the round-trip time (libp2p's pings, every
//! 2 s on each connection, so it includes the queue behind whatever the link carries) and the
//! throughput of the parameter payloads the peer sent (exchanges, state syncs). Both are moving
//! averages; they are observations for `nodectl status`, the status page and `/metrics`. The
//! peers the sync engine found on slow links are in the peer table, which the staleness gate
//! waits on (decision 0029).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use murmur_protocol::network::PeerId;
use murmur_sync::table::moving_average;

/// Weight of a new observation in the moving averages.
const NEW: f64 = 0.25;

/// Payloads smaller than this say more about latency than throughput: not counted.
const MIN_TIMED_PAYLOAD: u64 = 32 * 1024;

/// One peer's link figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkFigures {
    /// Round-trip time in milliseconds.
    pub rtt_ms: Option<f64>,
    /// Throughput of received payloads in Mbit/s.
    pub throughput_mbit_s: Option<f64>,
}

/// Every peer's link figures.
#[derive(Debug, Default)]
pub struct LinkTable {
    figures: Mutex<HashMap<PeerId, LinkFigures>>,
}

impl LinkTable {
    /// A round trip to `peer` took `rtt`.
    pub fn rtt(&self, peer: PeerId, rtt: Duration) {
        let mut figures = self.figures.lock().unwrap_or_else(|p| p.into_inner());
        let entry = figures.entry(peer).or_default();
        entry.rtt_ms = Some(moving_average(entry.rtt_ms, rtt.as_secs_f64() * 1e3, NEW));
    }

    /// A payload of `bytes` from `peer` took `took` to arrive once its header had; small ones
    /// are left out.
    pub fn received(&self, peer: PeerId, bytes: u64, took: Duration) {
        if bytes < MIN_TIMED_PAYLOAD || took.is_zero() {
            return;
        }
        let mbit_s = bytes as f64 * 8.0 / took.as_secs_f64() / 1e6;
        let mut figures = self.figures.lock().unwrap_or_else(|p| p.into_inner());
        let entry = figures.entry(peer).or_default();
        entry.throughput_mbit_s = Some(moving_average(entry.throughput_mbit_s, mbit_s, NEW));
    }

    pub fn of(&self, peer: &PeerId) -> LinkFigures {
        let figures = self.figures.lock().unwrap_or_else(|p| p.into_inner());
        figures.get(peer).copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_moving_averages_and_small_payloads_are_not_timed() {
        let links = LinkTable::default();
        let peer = PeerId::random();
        assert_eq!(links.of(&peer), LinkFigures::default());
        links.rtt(peer, Duration::from_millis(40));
        links.rtt(peer, Duration::from_millis(80));
        assert_eq!(links.of(&peer).rtt_ms, Some(50.0));
        links.received(peer, 1_000, Duration::from_millis(1));
        assert_eq!(links.of(&peer).throughput_mbit_s, None, "too small to time");
        // 1 MB in 80 ms: 100 Mbit/s.
        links.received(peer, 1_000_000, Duration::from_millis(80));
        let mbit_s = links.of(&peer).throughput_mbit_s.unwrap();
        assert!((mbit_s - 100.0).abs() < 1e-9, "{mbit_s}");
        assert_eq!(links.of(&PeerId::random()), LinkFigures::default());
    }
}
