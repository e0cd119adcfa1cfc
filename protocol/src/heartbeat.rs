//! The heartbeat every peer publishes on `murmur/<run-id>/heartbeat` once a second: small,
//! versioned CBOR, checked against the receiver's run and model before anything uses it.
//!
//! Each carries the time it was sent, strictly increasing per sender, which is also its
//! sequence number: a receiver ignores a heartbeat sent outside [`CLOCK_WINDOW`] of its own
//! clock, and one not newer than the last it took from that peer, so that a heartbeat or a
//! goodbye replayed by a third party changes nothing (decision 0040).

use serde::{Deserialize, Serialize};

/// Heartbeat layout version (2: the send time `t`).
pub const HEARTBEAT_VERSION: u16 = 2;
/// How far a heartbeat's send time may be from the receiver's clock. Past it, the heartbeat
/// is ignored (an old one replayed, or a clock that is wrong); within it, the receiver
/// remembers each peer's last send time, so a replay is refused by its sequence.
pub const CLOCK_WINDOW: std::time::Duration = std::time::Duration::from_secs(300);
/// Largest heartbeat accepted (a real one is about 120 bytes).
pub const MAX_HEARTBEAT_BYTES: usize = 512;

/// How a peer synchronises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// Trains alone (no mixing yet).
    Solo,
    Gossip,
    Elastic,
    Allreduce,
}

/// A peer's role in its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Worker,
    /// Holds the elastic-averaging center variable.
    Center,
    /// Just started and not yet caught up with the run (state sync pending): not a partner,
    /// and not counted by the staleness gate.
    Joining,
}

/// One peer's progress, as it announces it. Every peer sends one a second to every other, so
/// the field names on the wire are one letter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    #[serde(rename = "v")]
    pub version: u16,
    #[serde(rename = "r")]
    pub run_id: String,
    #[serde(rename = "f")]
    pub fingerprint: String,
    /// Local steps taken (the peer's clock).
    #[serde(rename = "s")]
    pub step: u64,
    #[serde(rename = "e")]
    pub epoch: u64,
    /// Exponential moving average of the training loss.
    #[serde(rename = "l")]
    pub loss_ema: f32,
    #[serde(rename = "n")]
    pub samples_seen: u64,
    #[serde(rename = "m")]
    pub mode: SyncMode,
    #[serde(rename = "o")]
    pub role: Role,
    /// Set in the last heartbeat of a peer that leaves gracefully.
    #[serde(rename = "x")]
    pub leaving: bool,
    /// The peer has trained to the end of the run: its clock stops, so it no longer holds
    /// back the staleness gate of the others.
    #[serde(rename = "d", default)]
    pub finished: bool,
    /// The peer cannot accept connections (client mode, decision 0066): it exchanges only with
    /// peers it dialled, and is never elected center nor let into a ring. Left out when false,
    /// so that a heartbeat of a node that is not a client is as it was.
    #[serde(rename = "c", default, skip_serializing_if = "is_false")]
    pub client: bool,
    /// When it was sent, in milliseconds since the Unix epoch by the sender's clock; strictly
    /// increasing per sender (see [`SendClock`]).
    #[serde(rename = "t")]
    pub sent_ms: u64,
}

fn is_false(value: &bool) -> bool {
    !value
}

/// Stamps a sender's heartbeats: the wall-clock time in milliseconds, or one more than the
/// last stamp when the clock has not moved on (or went back).
#[derive(Clone, Copy, Debug, Default)]
pub struct SendClock {
    last: u64,
}

impl SendClock {
    pub const fn new() -> Self {
        SendClock { last: 0 }
    }

    /// The stamp of a heartbeat sent at `now_ms`.
    pub fn stamp(&mut self, now_ms: u64) -> u64 {
        self.last = now_ms.max(self.last + 1);
        self.last
    }
}

/// This machine's wall-clock time in milliseconds since the Unix epoch.
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Why a heartbeat was ignored.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HeartbeatError {
    #[error("heartbeat of {len} bytes is over the {max}-byte cap")]
    TooLarge { len: usize, max: usize },
    #[error("malformed heartbeat: {0}")]
    Malformed(String),
    #[error("unsupported heartbeat version {found} (this node speaks {supported})")]
    UnknownVersion { found: u16, supported: u16 },
    #[error("heartbeat of run `{found}`, this node is in run `{expected}`")]
    WrongRun { expected: String, found: String },
    #[error("heartbeat for model `{found}`, ours is `{expected}`")]
    WrongFingerprint { expected: String, found: String },
    #[error(
        "heartbeat sent {skew_s} s from this machine's time (more than {window_s} s): replayed, \
         or one of the two clocks is wrong (keep clocks synchronised, e.g. by NTP)"
    )]
    OutOfWindow { skew_s: i64, window_s: u64 },
}

impl HeartbeatError {
    /// Whether the error is the sender's fault (scored against it). A heartbeat outside the
    /// clock window may be a third party's replay of a good one: ignored, not scored.
    pub fn is_offence(&self) -> bool {
        !matches!(self, HeartbeatError::OutOfWindow { .. })
    }
}

impl Heartbeat {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        ciborium::into_writer(self, &mut out).expect("invariant: a heartbeat serialises to a Vec");
        out
    }

    /// Decodes `bytes` and accepts the heartbeat only for `run_id` and `fingerprint`.
    pub fn decode(bytes: &[u8], run_id: &str, fingerprint: &str) -> Result<Self, HeartbeatError> {
        if bytes.len() > MAX_HEARTBEAT_BYTES {
            return Err(HeartbeatError::TooLarge {
                len: bytes.len(),
                max: MAX_HEARTBEAT_BYTES,
            });
        }
        let hb: Heartbeat =
            ciborium::from_reader(bytes).map_err(|e| HeartbeatError::Malformed(e.to_string()))?;
        if hb.version != HEARTBEAT_VERSION {
            return Err(HeartbeatError::UnknownVersion {
                found: hb.version,
                supported: HEARTBEAT_VERSION,
            });
        }
        if hb.run_id != run_id {
            return Err(HeartbeatError::WrongRun {
                expected: run_id.to_owned(),
                found: hb.run_id,
            });
        }
        if hb.fingerprint != fingerprint {
            return Err(HeartbeatError::WrongFingerprint {
                expected: fingerprint.to_owned(),
                found: hb.fingerprint,
            });
        }
        // No training loss is NaN or infinite (a diverged trainer stops, decision 0037), and
        // such a value would leave the peer list of `nodectl status` unreadable (JSON has no
        // NaN).
        if !hb.loss_ema.is_finite() {
            return Err(HeartbeatError::Malformed(format!(
                "loss {} is not finite",
                hb.loss_ema
            )));
        }
        Ok(hb)
    }

    /// Refuses a heartbeat sent more than `window` from `now_ms` (this machine's clock).
    pub fn check_clock(
        &self,
        now_ms: u64,
        window: std::time::Duration,
    ) -> Result<(), HeartbeatError> {
        let skew_ms = i128::from(self.sent_ms) - i128::from(now_ms);
        if skew_ms.unsigned_abs() > window.as_millis() {
            return Err(HeartbeatError::OutOfWindow {
                skew_s: i64::try_from(skew_ms / 1000).unwrap_or(i64::MAX),
                window_s: window.as_secs(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Heartbeat {
        Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: "run-1".into(),
            fingerprint: "abcd".into(),
            step: 120,
            epoch: 1,
            loss_ema: 0.42,
            samples_seen: 7680,
            mode: SyncMode::Gossip,
            role: Role::Worker,
            leaving: false,
            finished: false,
            client: false,
            sent_ms: 1_795_000_000_000,
        }
    }

    #[test]
    fn a_client_says_so_and_a_full_peer_sends_what_it_sent_before() {
        let full = sample();
        let client = Heartbeat {
            client: true,
            ..sample()
        };
        let (full_bytes, client_bytes) = (full.encode(), client.encode());
        // The key `c` and `true`: a full peer's heartbeat has no such field, as before clients.
        assert_eq!(client_bytes.len(), full_bytes.len() + 3);
        assert!(
            Heartbeat::decode(&client_bytes, "run-1", "abcd")
                .unwrap()
                .client
        );
        assert!(
            !Heartbeat::decode(&full_bytes, "run-1", "abcd")
                .unwrap()
                .client
        );
    }

    /// Found by the `heartbeat` fuzz target: a heartbeat announcing a NaN loss was accepted.
    #[test]
    fn a_heartbeat_whose_loss_is_not_finite_is_refused() {
        const FUZZED: [u8; 69] = [
            0xac, 0x61, 0x76, 0x02, 0x61, 0x72, 0x64, 0x66, 0x75, 0x7a, 0x7a, 0x61, 0x66, 0x62,
            0x66, 0x70, 0x61, 0x73, 0x19, 0x00, 0x81, 0x61, 0x65, 0x02, 0x61, 0x6c, 0xf9, 0x7e,
            0x00, 0x61, 0x6e, 0x1a, 0x00, 0x01, 0x2c, 0x00, 0x61, 0x6d, 0x66, 0x67, 0x6f, 0x73,
            0x73, 0x69, 0x70, 0x61, 0x6f, 0x66, 0x77, 0x6f, 0x72, 0x6b, 0x65, 0x72, 0x61, 0x78,
            0xf4, 0x61, 0x64, 0xf5, 0x61, 0x74, 0x00, 0x01, 0xa0, 0xc4, 0x50, 0x6c, 0x00,
        ];
        let refused = Heartbeat::decode(&FUZZED, "fuzz", "fp").unwrap_err();
        assert!(
            refused.to_string().contains("loss NaN is not finite"),
            "{refused}"
        );
        assert!(refused.is_offence());
        for loss in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let hb = Heartbeat {
                loss_ema: loss,
                ..sample()
            };
            assert!(
                Heartbeat::decode(&hb.encode(), "run-1", "abcd").is_err(),
                "{loss}"
            );
        }
    }

    #[test]
    fn send_stamps_increase_and_the_window_is_both_ways() {
        let mut clock = SendClock::default();
        assert_eq!(clock.stamp(1_000), 1_000);
        assert_eq!(clock.stamp(1_000), 1_001, "same millisecond");
        assert_eq!(clock.stamp(900), 1_002, "the clock went back");
        assert_eq!(clock.stamp(5_000), 5_000);
        let hb = sample();
        let window = CLOCK_WINDOW;
        let at = hb.sent_ms;
        assert!(hb.check_clock(at, window).is_ok());
        assert!(hb.check_clock(at + 299_000, window).is_ok());
        let late = hb.check_clock(at + 301_000, window).unwrap_err();
        assert!(
            matches!(late, HeartbeatError::OutOfWindow { skew_s: -301, .. }),
            "{late}"
        );
        assert!(!late.is_offence());
        assert!(
            hb.check_clock(at - 301_000, window).is_err(),
            "from the future"
        );
    }

    #[test]
    fn round_trips_and_stays_small() {
        let hb = sample();
        let bytes = hb.encode();
        assert!(bytes.len() < 80, "{} bytes", bytes.len());
        assert_eq!(Heartbeat::decode(&bytes, "run-1", "abcd").unwrap(), hb);
    }

    #[test]
    fn other_runs_models_and_versions_are_refused() {
        let bytes = sample().encode();
        assert!(matches!(
            Heartbeat::decode(&bytes, "run-2", "abcd"),
            Err(HeartbeatError::WrongRun { .. })
        ));
        assert!(matches!(
            Heartbeat::decode(&bytes, "run-1", "ffff"),
            Err(HeartbeatError::WrongFingerprint { .. })
        ));
        let future = Heartbeat {
            version: 3,
            ..sample()
        };
        assert!(matches!(
            Heartbeat::decode(&future.encode(), "run-1", "abcd"),
            Err(HeartbeatError::UnknownVersion { found: 3, .. })
        ));
        assert!(matches!(
            Heartbeat::decode(&[0u8; 600], "run-1", "abcd"),
            Err(HeartbeatError::TooLarge { .. })
        ));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Heartbeat::decode(&bytes, "run-1", "abcd");
        }
    }
}
