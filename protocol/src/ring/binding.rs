//! Binding an attempt's connections, sans IO: which hello an attempt takes as its left link,
//! and what an opener makes of the answer to its own. The daemon's data plane
//! (`data_plane::connect_ring`) drives these over libp2p streams; the simulator delivers the
//! same [`Control`] messages over its virtual links, so both bind by the one rule.
//!
//! Members number the attempts at a round, and a connection joins two attempts of the same
//! round and number only (decision 0017):
//!
//! - a hello of an earlier attempt from the left neighbour is refused as stale, and the refusal
//!   says which attempt this member is at, so that its opener, if behind, is superseded;
//! - one of a later attempt from the left neighbour ends this member's attempt as superseded,
//!   and is kept for the next attempt to take first;
//! - any other hello that is not from the trusted left neighbour of the same run, membership
//!   and data plane is refused; if it came from the left neighbour the attempt fails with it,
//!   otherwise the attempt goes on to the next hello.

use libp2p_identity::PeerId;

use super::control::{Control, Hello, TOKEN_BYTES};
use super::{Attempt, DataPlane, RingError, RingMembers};
use crate::trust::TrustList;

/// The left member's side of one connection: the hello it opens with, and what it makes of
/// the right member's answer.
#[derive(Clone, Debug)]
pub struct Opener {
    hello: Hello,
}

/// How the right member took an opener's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answered {
    /// The stream that carried the hello is the data connection (the libp2p plane).
    Keep,
    /// Connect over TCP to `addr` and present `token` first (the TCP plane).
    Connect {
        addr: std::net::SocketAddr,
        token: [u8; TOKEN_BYTES],
    },
}

impl Opener {
    /// The opener of `attempt` at the ring of `members` in run `run_id`, on `plane`.
    pub fn new(run_id: &str, members: &RingMembers, plane: DataPlane, attempt: Attempt) -> Self {
        Opener {
            hello: Hello {
                run_id: run_id.to_owned(),
                membership: members.hash(),
                plane,
                attempt,
            },
        }
    }

    /// The message that opens the connection.
    pub fn hello(&self) -> Control {
        Control::Hello(self.hello.clone())
    }

    /// What the right member `right`'s `answer` means for this attempt: the data connection's
    /// terms, or why there is none (superseded when the refuser is at a later attempt).
    pub fn answered(&self, right: &PeerId, answer: Control) -> Result<Answered, RingError> {
        let (plane, attempt) = (self.hello.plane, self.hello.attempt);
        match answer {
            Control::Accept if plane == DataPlane::Libp2p => Ok(Answered::Keep),
            Control::Connect { addr, token } if plane == DataPlane::Tcp => {
                Ok(Answered::Connect { addr, token })
            }
            Control::Refuse {
                ahead: Some(ahead), ..
            } if ahead > attempt => Err(RingError::Superseded { by: ahead }),
            Control::Refuse { reason, .. } => {
                Err(RingError::Setup(format!("{right} refused: {reason}")))
            }
            other => Err(RingError::Malformed(format!(
                "unexpected answer to a {plane} hello: {other:?}"
            ))),
        }
    }
}

/// The right member's side: decides on each hello that its attempt takes off the queue.
#[derive(Clone, Debug)]
pub struct Acceptor {
    run_id: String,
    membership: u64,
    left: PeerId,
    plane: DataPlane,
    attempt: Attempt,
}

/// What an attempt does with a hello.
#[derive(Debug)]
pub enum OnHello {
    /// From the left neighbour, for this membership and attempt: answer as the plane says
    /// (keep the stream, or hand out a TCP token) and take it as the left link.
    Bind,
    /// Write `answer` (a refusal) and take the next hello.
    Skip { answer: Control },
    /// Write `answer` (a refusal); this attempt fails with `error`.
    Fail { answer: Control, error: RingError },
    /// A later attempt of the left neighbour: this attempt ends with
    /// [`RingError::Superseded`], and the hello is kept, unanswered, for the next attempt.
    Superseded { by: Attempt },
}

impl Acceptor {
    /// `me`'s side of `attempt` at the ring of `members` in run `run_id`, on `plane`.
    pub fn new(
        run_id: &str,
        members: &RingMembers,
        me: &PeerId,
        plane: DataPlane,
        attempt: Attempt,
    ) -> Result<Self, RingError> {
        let rank = members
            .rank_of(me)
            .ok_or_else(|| RingError::Setup("this node is not in the ring".into()))?;
        Ok(Acceptor {
            run_id: run_id.to_owned(),
            membership: members.hash(),
            left: members.left_of(rank),
            plane,
            attempt,
        })
    }

    /// The member whose hello this attempt binds.
    pub fn left(&self) -> PeerId {
        self.left
    }

    /// What to do with `hello`, which `from` opened a stream with; only peers in `trust` are
    /// taken.
    pub fn on_hello(&self, from: &PeerId, hello: &Hello, trust: &TrustList) -> OnHello {
        let from_left = *from == self.left;
        let refuse = |reason: String, ahead: Option<Attempt>| Control::Refuse { reason, ahead };
        if from_left && trust.contains(from) && hello.attempt != self.attempt {
            if hello.attempt < self.attempt {
                let answer = refuse("a stale attempt".to_owned(), Some(self.attempt));
                return OnHello::Skip { answer };
            }
            return OnHello::Superseded { by: hello.attempt };
        }
        let (reason, error) = if !trust.contains(from) {
            let reason = format!("{from} is not in this node's trust list");
            (reason, RingError::Untrusted(from.to_string()))
        } else if hello.run_id != self.run_id {
            let reason = format!("run `{}` is not ours (`{}`)", hello.run_id, self.run_id);
            (reason.clone(), RingError::Setup(reason))
        } else if hello.membership != self.membership {
            let reason = format!(
                "membership {:016x} is not ours ({:016x})",
                hello.membership, self.membership
            );
            (reason.clone(), RingError::Setup(reason))
        } else if !from_left {
            let reason = format!("{from} is not our left neighbour");
            (reason.clone(), RingError::Setup(reason))
        } else if hello.plane != self.plane {
            let reason = format!("this ring runs on {}, not {}", self.plane, hello.plane);
            (reason.clone(), RingError::Setup(reason))
        } else {
            return OnHello::Bind;
        };
        let answer = refuse(reason, None);
        if from_left {
            OnHello::Fail { answer, error }
        } else {
            OnHello::Skip { answer }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Ring {
        members: RingMembers,
        trust: TrustList,
    }

    /// A ring of three trusted members.
    fn ring() -> Ring {
        let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        Ring {
            trust: TrustList::new(peers.iter().copied()),
            members: RingMembers::new("run", peers),
        }
    }

    fn attempt(round: u64, number: u32) -> Attempt {
        Attempt { round, number }
    }

    fn hello_of(opener: &Opener) -> Hello {
        match opener.hello() {
            Control::Hello(hello) => hello,
            other => panic!("an opener opens with a hello, not {other:?}"),
        }
    }

    /// Member 1's acceptor and member 0 (its left neighbour)'s opener, at `theirs`.
    fn pair(ring: &Ring, ours: Attempt, theirs: Attempt) -> (Acceptor, Opener) {
        let me = ring.members.peers()[1];
        let acceptor =
            Acceptor::new("run", &ring.members, &me, DataPlane::Libp2p, ours).expect("a member");
        let opener = Opener::new("run", &ring.members, DataPlane::Libp2p, theirs);
        (acceptor, opener)
    }

    #[test]
    fn the_left_neighbours_hello_of_the_same_attempt_binds_and_its_opener_keeps_the_stream() {
        let ring = ring();
        let (acceptor, opener) = pair(&ring, attempt(5, 2), attempt(5, 2));
        let left = acceptor.left();
        assert_eq!(left, ring.members.peers()[0]);
        let verdict = acceptor.on_hello(&left, &hello_of(&opener), &ring.trust);
        assert!(matches!(verdict, OnHello::Bind), "{verdict:?}");
        let right = ring.members.peers()[1];
        assert_eq!(
            opener.answered(&right, Control::Accept).unwrap(),
            Answered::Keep
        );
    }

    /// An earlier attempt is refused with this member's attempt, which supersedes its opener;
    /// a later one supersedes this member's attempt and is not answered.
    #[test]
    fn attempts_bind_only_to_the_same_number_and_the_later_one_wins() {
        let ring = ring();
        let right = ring.members.peers()[1];
        let (acceptor, stale) = pair(&ring, attempt(5, 3), attempt(5, 2));
        let left = acceptor.left();
        let OnHello::Skip { answer } = acceptor.on_hello(&left, &hello_of(&stale), &ring.trust)
        else {
            panic!("a stale hello is refused and skipped");
        };
        match stale.answered(&right, answer) {
            Err(RingError::Superseded { by }) => assert_eq!(by, attempt(5, 3)),
            other => panic!("the stale opener is superseded by attempt 3, not {other:?}"),
        }
        let (acceptor, later) = pair(&ring, attempt(5, 3), attempt(6, 1));
        match acceptor.on_hello(&left, &hello_of(&later), &ring.trust) {
            OnHello::Superseded { by } => assert_eq!(by, attempt(6, 1)),
            other => panic!("a later attempt supersedes this one, not {other:?}"),
        }
    }

    /// A refusal that names an attempt no later than the opener's (it crossed a retry) is a
    /// set-up failure, not a supersession.
    #[test]
    fn a_refusal_naming_an_earlier_attempt_does_not_supersede() {
        let ring = ring();
        let (_, opener) = pair(&ring, attempt(5, 1), attempt(5, 2));
        let answer = Control::Refuse {
            reason: "a stale attempt".into(),
            ahead: Some(attempt(5, 1)),
        };
        let right = ring.members.peers()[1];
        assert!(matches!(
            opener.answered(&right, answer),
            Err(RingError::Setup(_))
        ));
    }

    /// A mismatch from the left neighbour fails the attempt; the same from anyone else is
    /// refused and skipped, and an untrusted caller is refused whatever its hello says.
    #[test]
    fn mismatched_hellos_fail_the_attempt_from_the_left_and_are_skipped_from_others() {
        let ring = ring();
        let (acceptor, opener) = pair(&ring, attempt(5, 1), attempt(5, 1));
        let left = acceptor.left();
        let other_ring = RingMembers::new("run", ring.members.peers()[..2].to_vec());
        let mut foreign = hello_of(&opener);
        foreign.membership = other_ring.hash();
        match acceptor.on_hello(&left, &foreign, &ring.trust) {
            OnHello::Fail {
                answer: Control::Refuse { ahead: None, .. },
                error: RingError::Setup(reason),
            } => assert!(reason.contains("membership"), "{reason}"),
            other => panic!("another membership from the left fails the attempt: {other:?}"),
        }
        let mut tcp = hello_of(&opener);
        tcp.plane = DataPlane::Tcp;
        assert!(matches!(
            acceptor.on_hello(&left, &tcp, &ring.trust),
            OnHello::Fail { .. }
        ));
        let not_left = ring.members.peers()[2];
        assert!(matches!(
            acceptor.on_hello(&not_left, &hello_of(&opener), &ring.trust),
            OnHello::Skip {
                answer: Control::Refuse { ahead: None, .. }
            }
        ));
        let stranger = PeerId::random();
        assert!(matches!(
            acceptor.on_hello(&stranger, &hello_of(&opener), &ring.trust),
            OnHello::Skip { .. }
        ));
        let untrusting = TrustList::new([ring.members.peers()[2]]);
        assert!(matches!(
            acceptor.on_hello(&left, &hello_of(&opener), &untrusting),
            OnHello::Fail {
                error: RingError::Untrusted(_),
                ..
            }
        ));
    }

    /// An answer of the other plane, or a hello where an answer is due, is malformed.
    #[test]
    fn an_answer_the_plane_does_not_expect_is_malformed() {
        let ring = ring();
        let (_, opener) = pair(&ring, attempt(5, 1), attempt(5, 1));
        let right = ring.members.peers()[1];
        let tcp = Control::Connect {
            addr: "127.0.0.1:4000".parse().unwrap(),
            token: [0; TOKEN_BYTES],
        };
        for answer in [tcp, opener.hello()] {
            assert!(matches!(
                opener.answered(&right, answer),
                Err(RingError::Malformed(_))
            ));
        }
    }
}
