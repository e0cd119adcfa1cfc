//! Why something a peer sent was refused: what the screen and the engine's checks find, and
//! what the membership actor scores as an offence.

/// Why something a peer sent was refused.
#[derive(Clone, Debug, PartialEq)]
pub enum Rejection {
    /// A frame that does not decode, or is of another run or model (the wire's reason).
    Frame(String),
    /// A frame of a kind that has no place here.
    Unexpected { what: &'static str, kind: String },
    /// A tensor of the wrong length.
    WrongLength {
        what: &'static str,
        found: usize,
        expected: usize,
    },
    /// A tensor with NaN or infinite values.
    NotFinite { what: &'static str },
    /// Parameters (or a delta) farther from this replica than the running limit.
    Outlier { distance: f64, limit: f64 },
    /// Optimizer state of another optimizer, or inconsistent.
    ForeignState(String),
    /// An exchange opened and never completed within the exchange timeout.
    Stalled,
    /// Something invalid on a ring connection.
    Ring(String),
    /// A heartbeat of another run or model, or malformed.
    Heartbeat(String),
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::Frame(reason) | Rejection::ForeignState(reason) => f.write_str(reason),
            Rejection::Unexpected { what, kind } => write!(f, "sent {kind} {what}"),
            Rejection::WrongLength {
                what,
                found,
                expected,
            } => write!(f, "{what}: {found} values, this model has {expected}"),
            Rejection::NotFinite { what } => write!(f, "{what} contain NaN or infinite values"),
            Rejection::Outlier { distance, limit } => write!(
                f,
                "distance {distance:.4} is over the limit {limit:.4} (10x the running median)"
            ),
            Rejection::Stalled => f.write_str("no complete exchange within the exchange timeout"),
            Rejection::Ring(reason) => write!(f, "ring: {reason}"),
            Rejection::Heartbeat(reason) => f.write_str(reason),
        }
    }
}
