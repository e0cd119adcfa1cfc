//! Which peers the staleness gate waits for, so that no peer can stall it by its clock
//! (decision 0039). Clocks are self-reported: a stranger that heartbeats step 0 would hold
//! every gated peer `max_staleness` steps later for as long as it liked. Here:
//!
//! - A peer is waited for only once its clock has been within the bound of this node's
//!   (*caught up*): a new identity that claims to be far behind holds no one back, so fresh
//!   identities buy nothing.
//! - Waiting is on a budget: the *debt* grows while the gate is closed and is paid back at the
//!   same rate while it is open. When it reaches `patience`, the peers that hold the gate are
//!   *uncoupled* (a strike each) until they catch up again, so however many peers lag, the
//!   node trains at least about half the time once the debt is full.
//! - A peer uncoupled [`MAX_STRIKES`] times is not waited for again in this run.
//!
//! Sans-IO like the rest of the sync rules: callers pass the steps and the time.

use std::collections::HashMap;
use std::hash::Hash;

use foldhash::fast::RandomState;
use std::time::{Duration, Instant};

/// How many times a peer may be uncoupled for lagging before it stays uncoupled.
pub const MAX_STRIKES: u32 = 3;

/// Peers remembered at most; past it, those not offered in the last call are forgotten (a
/// forgotten peer starts over as not caught up, so forgetting frees no one from the rules).
const MAX_TRACKED: usize = 4096;

/// A peer's standing at the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Not yet within the bound of this node's clock: not waited for.
    CatchingUp,
    /// Waited for.
    Coupled,
    /// Held the gate past the patience: not waited for until it catches up (and never again
    /// after [`MAX_STRIKES`]).
    Uncoupled,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    standing: Standing,
    strikes: u32,
}

/// What the gate compares against, and what changed.
#[derive(Clone, Debug, PartialEq)]
pub struct GateClock<P> {
    /// The smallest clock among the peers waited for (`None`: none).
    pub slowest: Option<u64>,
    /// Peers uncoupled by this call, with their clocks.
    pub uncoupled: Vec<(P, u64)>,
    /// When the gate is closed: the moment the debt reaches the patience, at which the caller
    /// asks again even if no clock has moved.
    pub decide_at: Option<Instant>,
}

/// The peers a node's staleness gate waits for (see the module documentation).
#[derive(Clone, Debug)]
pub struct Coupling<P> {
    bound: u64,
    patience: Duration,
    debt: Duration,
    /// When the last call was, and whether the gate was closed after it.
    last: Option<(Instant, bool)>,
    /// Every peer offered (past [`MAX_TRACKED`], the last call's only), kept in the order
    /// of the last call's candidates. The gate is asked before every step with every live
    /// peer, and callers offer the same peers in the same order call after call: a candidate
    /// is found at its position by one comparison. Looking each one up by its id's hash was
    /// a quarter of the simulator's time.
    entries: Vec<(P, Entry)>,
    /// Where each peer's entry lies in `entries`, for candidates out of that order. foldhash
    /// is seeded per map, so identities a stranger grinds cannot be aimed at one bucket.
    index: HashMap<P, usize, RandomState>,
}

impl<P: Eq + Hash + Clone> Coupling<P> {
    /// A gate with bound `max_staleness` steps that waits at most about `patience` at a
    /// stretch for peers that lag.
    pub fn new(max_staleness: u64, patience: Duration) -> Self {
        Coupling {
            bound: max_staleness,
            patience,
            debt: Duration::ZERO,
            last: None,
            entries: Vec::new(),
            index: HashMap::default(),
        }
    }

    /// Whether `peer` at clock `step` holds back a node at `own_step` from its next step.
    fn holds(&self, step: u64, own_step: u64) -> bool {
        step.saturating_add(self.bound) <= own_step
    }

    /// The standing of `peer`, if it was ever offered.
    pub fn standing(&self, peer: &P) -> Option<Standing> {
        self.index
            .get(peer)
            .map(|&slot| self.entries[slot].1.standing)
    }

    /// The slot of `peer`, offered as candidate number `position`, moved to `position` so that
    /// the next call finds it there at once; a new peer gets an entry, not caught up.
    fn slot(&mut self, position: usize, peer: &P) -> usize {
        if self.entries.get(position).is_some_and(|(p, _)| p == peer) {
            return position;
        }
        let slot = match self.index.get(peer) {
            Some(&slot) => slot,
            None => {
                let entry = Entry {
                    standing: Standing::CatchingUp,
                    strikes: 0,
                };
                self.entries.push((peer.clone(), entry));
                self.index.insert(peer.clone(), self.entries.len() - 1);
                self.entries.len() - 1
            }
        };
        // The slots before `position` hold this call's earlier candidates.
        if slot <= position {
            return slot;
        }
        self.entries.swap(slot, position);
        for moved in [slot, position] {
            let owner = self.entries[moved].0.clone();
            self.index.insert(owner, moved);
        }
        position
    }

    /// The clock a node at `own_step` gates on at `now`, given the live peers it could wait
    /// for and their clocks (`candidates`), updating every peer's standing.
    pub fn gate_clock(
        &mut self,
        own_step: u64,
        candidates: impl IntoIterator<Item = (P, u64)>,
        now: Instant,
    ) -> GateClock<P> {
        if let Some((then, closed)) = self.last {
            let spent = now.saturating_duration_since(then);
            self.debt = if closed {
                self.debt + spent
            } else {
                self.debt.saturating_sub(spent)
            };
        }
        let out_of_patience = self.debt >= self.patience;
        let mut slowest: Option<u64> = None;
        let mut uncoupled = Vec::new();
        let mut offered = 0;
        for (position, (peer, step)) in candidates.into_iter().enumerate() {
            offered = position + 1;
            let holds = self.holds(step, own_step);
            let slot = self.slot(position, &peer);
            let entry = &mut self.entries[slot].1;
            if !holds && entry.strikes < MAX_STRIKES {
                entry.standing = Standing::Coupled;
            }
            if entry.standing != Standing::Coupled {
                continue;
            }
            if holds && out_of_patience {
                entry.standing = Standing::Uncoupled;
                entry.strikes += 1;
                uncoupled.push((peer, step));
                continue;
            }
            slowest = Some(slowest.map_or(step, |s| s.min(step)));
        }
        // This call's candidates lie first: past the cap, the others are forgotten.
        if self.entries.len() > MAX_TRACKED.max(offered) {
            self.entries.truncate(offered);
            self.index.retain(|_, slot| *slot < offered);
        }
        let closed = slowest.is_some_and(|s| self.holds(s, own_step));
        self.last = Some((now, closed));
        GateClock {
            slowest,
            uncoupled,
            decide_at: closed.then(|| now + self.patience.saturating_sub(self.debt)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: u64 = 10;

    fn at(t0: Instant, secs: u64) -> Instant {
        t0 + Duration::from_secs(secs)
    }

    #[test]
    fn a_peer_is_waited_for_once_caught_up_and_a_new_laggard_never() {
        let t0 = Instant::now();
        let mut c = Coupling::new(BOUND, Duration::from_secs(5));
        // "a" is within the bound from the start; "liar" claims step 0 while we are at 50.
        let g = c.gate_clock(50, [("a", 45), ("liar", 0)], t0);
        assert_eq!(g.slowest, Some(45));
        assert_eq!(c.standing(&"liar"), Some(Standing::CatchingUp));
        assert_eq!(g.decide_at, None, "the gate is open");
        // Once it has caught up, it is waited for like anyone.
        c.gate_clock(50, [("a", 50), ("liar", 48)], at(t0, 1));
        assert_eq!(c.standing(&"liar"), Some(Standing::Coupled));
    }

    #[test]
    fn peers_that_hold_the_gate_past_the_patience_are_uncoupled_until_they_catch_up() {
        let t0 = Instant::now();
        let mut c = Coupling::new(BOUND, Duration::from_secs(5));
        c.gate_clock(0, [("a", 0), ("b", 0)], t0);
        // We reach step 10; "b" stays at 0 and holds the gate: a deadline 5 s away.
        let g = c.gate_clock(10, [("a", 10), ("b", 0)], at(t0, 1));
        assert_eq!(g.slowest, Some(0));
        assert_eq!(g.decide_at, Some(at(t0, 6)));
        // Still held 4 s later: the debt is 4 s, one more to go.
        let g = c.gate_clock(10, [("a", 10), ("b", 0)], at(t0, 5));
        assert_eq!(g.decide_at, Some(at(t0, 6)));
        assert!(g.uncoupled.is_empty());
        // At the patience: "b" is uncoupled, the gate opens on "a".
        let g = c.gate_clock(10, [("a", 10), ("b", 0)], at(t0, 6));
        assert_eq!(g.uncoupled, [("b", 0)]);
        assert_eq!(g.slowest, Some(10));
        assert_eq!(g.decide_at, None);
        // Open for 5 s pays the debt back; "b" catches up and is waited for again.
        c.gate_clock(20, [("a", 20), ("b", 0)], at(t0, 11));
        let g = c.gate_clock(20, [("a", 20), ("b", 15)], at(t0, 12));
        assert_eq!(c.standing(&"b"), Some(Standing::Coupled));
        assert_eq!(g.slowest, Some(15));
    }

    #[test]
    fn a_peer_that_keeps_lagging_is_dropped_for_good_after_its_strikes() {
        let t0 = Instant::now();
        let patience = Duration::from_secs(2);
        let mut c = Coupling::new(BOUND, patience);
        let mut now = t0;
        let mut own = 0;
        for strike in 1..=MAX_STRIKES {
            // It catches up, then lags until it is uncoupled.
            c.gate_clock(own, [("b", own)], now);
            assert_eq!(c.standing(&"b"), Some(Standing::Coupled), "strike {strike}");
            own += BOUND;
            let g = c.gate_clock(own, [("b", own - BOUND)], now);
            let decide = g.decide_at.unwrap();
            let g = c.gate_clock(own, [("b", own - BOUND)], decide);
            assert_eq!(g.uncoupled.len(), 1, "strike {strike}");
            // The open gate pays the debt back before the next round.
            now = decide + patience * 2;
            c.gate_clock(own, [], now);
        }
        c.gate_clock(own, [("b", own)], now);
        assert_eq!(c.standing(&"b"), Some(Standing::Uncoupled));
    }

    #[test]
    fn many_laggards_cost_one_patience_not_one_each() {
        let t0 = Instant::now();
        let mut c = Coupling::new(BOUND, Duration::from_secs(5));
        let peers: Vec<(u32, u64)> = (0..50).map(|p| (p, 0)).collect();
        c.gate_clock(0, peers.clone(), t0);
        let g = c.gate_clock(10, peers.clone(), t0);
        let g = c.gate_clock(10, peers.clone(), g.decide_at.unwrap());
        assert_eq!(g.uncoupled.len(), 50);
        assert_eq!(g.slowest, None);
    }

    /// Candidates are kept in the order last offered; offered in another order, each keeps its
    /// own standing.
    #[test]
    fn a_peers_standing_follows_it_whatever_the_order_of_the_candidates() {
        let t0 = Instant::now();
        let mut c = Coupling::new(BOUND, Duration::from_secs(5));
        c.gate_clock(50, [("near", 45), ("far", 0), ("new", 49)], t0);
        let g = c.gate_clock(50, [("late", 0), ("new", 49), ("far", 1), ("near", 46)], t0);
        assert_eq!(g.slowest, Some(46));
        for (peer, standing) in [
            ("near", Standing::Coupled),
            ("new", Standing::Coupled),
            ("far", Standing::CatchingUp),
            ("late", Standing::CatchingUp),
        ] {
            assert_eq!(c.standing(&peer), Some(standing), "{peer}");
        }
        let g = c.gate_clock(50, [("far", 48), ("near", 47)], t0);
        assert_eq!(g.slowest, Some(47));
        assert_eq!(c.standing(&"far"), Some(Standing::Coupled));
        assert_eq!(
            c.standing(&"new"),
            Some(Standing::Coupled),
            "not offered, not forgotten"
        );
    }

    /// Past [`MAX_TRACKED`] peers, those not offered in the last call are forgotten: one
    /// offered again starts over, not caught up.
    #[test]
    fn past_the_cap_peers_not_offered_are_forgotten() {
        let t0 = Instant::now();
        let mut c = Coupling::new(BOUND, Duration::from_secs(5));
        c.gate_clock(50, [(0u32, 50)], t0);
        assert_eq!(c.standing(&0), Some(Standing::Coupled));
        let crowd: Vec<(u32, u64)> = (1..=MAX_TRACKED as u32).map(|p| (p, 0)).collect();
        c.gate_clock(50, crowd.clone(), t0);
        assert_eq!(c.standing(&0), None, "forgotten");
        assert_eq!(c.standing(&1), Some(Standing::CatchingUp));
        let g = c.gate_clock(50, [(0, 0), (7, 45)], t0);
        assert_eq!(c.standing(&0), Some(Standing::CatchingUp), "starts over");
        assert_eq!(g.slowest, Some(45));
    }
}
