//! The heartbeat every peer publishes on `murmur/<run-id>/heartbeat` once a second: small,
//! versioned CBOR, checked against the receiver's run and model before anything uses it.

use serde::{Deserialize, Serialize};

/// Heartbeat layout version.
pub const HEARTBEAT_VERSION: u16 = 1;
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
        Ok(hb)
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
        }
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
            version: 2,
            ..sample()
        };
        assert!(matches!(
            Heartbeat::decode(&future.encode(), "run-1", "abcd"),
            Err(HeartbeatError::UnknownVersion { found: 2, .. })
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
