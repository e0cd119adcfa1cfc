//! Elastic averaging around a center: the election, the center's seeding, requests to it.

use libp2p_identity::PeerId;
use murmur_protocol::heartbeat::Role;
use murmur_protocol::sync::{CenterTracker, ClipRule, elect_center};
use tracing::{debug, info};

use super::{Action, Judge, Outcome, Policy, View};
use crate::settings::Election;

/// The elastic center's side of the policy: the election this node follows, and the center
/// variable it may hold.
#[derive(Debug)]
pub(super) struct CenterPolicy {
    pub(super) tracker: CenterTracker<PeerId>,
    /// This node holds the center variable.
    pub(super) holds: bool,
    /// This node was elected and its center variable is being seeded.
    pub(super) seeding: bool,
    /// Norms of elastic deltas from the center.
    deltas: Judge,
}

impl CenterPolicy {
    pub(super) fn new() -> Self {
        CenterPolicy {
            tracker: CenterTracker::default(),
            holds: false,
            seeding: false,
            deltas: Judge::new(ClipRule::CENTER),
        }
    }

    /// The center this node follows.
    pub(super) fn center(&self) -> Option<PeerId> {
        self.tracker.center().copied()
    }
}

impl Policy {
    /// Elastic worker: the due snapshot goes to the center (or, at the center, to its own
    /// center variable).
    pub(super) fn ask_center(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(elastic) = self.center.as_ref() else {
            return self.release();
        };
        let (holds, screen) = (elastic.holds, elastic.deltas.screen(view.now));
        let Some(center) = elastic.center() else {
            return self.release();
        };
        if center == self.me {
            if !holds {
                return self.release();
            }
            // The engine steps the center and hands the trainer the delta.
            self.due = None;
            return vec![Action::StepOwnCenter {
                alpha: self.sync.alpha(self.live_count(view)),
            }];
        }
        // A center reached only through a relay is asked once a direct connection is up.
        if !view
            .peers
            .exchanges_with(&center, self.sync.relayed_exchanges)
        {
            debug!(%center, "no direct connection to the center: this interval trains on");
            return self.release();
        }
        if let Some(due) = self.due.as_mut() {
            due.asking = Some(center);
        }
        vec![Action::AskCenter {
            peer: center,
            screen,
        }]
    }

    pub(super) fn on_center_answer(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        let deltas = self.center.as_mut().map(|c| &mut c.deltas);
        match outcome {
            Outcome::Mixed { distance, credited } => {
                if let Some(deltas) = deltas {
                    deltas.accepted(peer, distance, credited, view.now);
                }
                self.mixed |= self.in_step_with(peer, view);
                self.due = None;
                return actions;
            }
            // The center is the one source of deltas.
            Outcome::Outlier { distance } => {
                if let Some(deltas) = deltas {
                    deltas.outlier(peer, distance, 1);
                }
            }
            Outcome::Rejected(rejection) => actions.push(Action::Offence { peer, rejection }),
            Outcome::Busy | Outcome::Stale | Outcome::Failed(_) | Outcome::StateSent => {}
        }
        actions.extend(self.release());
        actions
    }

    /// Follows the deterministic election; a node that becomes the center seeds the center
    /// variable.
    pub(super) fn elect(&mut self, view: &View<'_>) -> Vec<Action> {
        let elected = self.elected(view);
        let me = self.me;
        let Some(elastic) = self.center.as_mut() else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        let changed = elastic.tracker.update(elected);
        if let Some(version) = changed
            && elected != Some(me)
        {
            if elastic.holds {
                actions.push(Action::DropCenter);
            }
            elastic.holds = false;
            match elected {
                Some(center) => info!(center = %center, version, "elastic center elected"),
                None => info!(version, "no elastic center while alone"),
            }
        }
        let seed = elected == Some(me) && !elastic.holds && !elastic.seeding;
        elastic.seeding |= seed;
        if changed.is_some() {
            if elected != Some(me) && self.role == Role::Center {
                self.role = Role::Worker;
            }
            actions.push(Action::Publish(self.view()));
        }
        if seed {
            actions.push(Action::SeedCenter);
        }
        actions
    }

    /// The center the deterministic election names among the coupled peers (and this node,
    /// once it has joined). Unless the run opts into an open election, only trusted peers and
    /// the configured center stand: identities cost nothing, so a stranger can grind one that
    /// wins an open election (decisions 0047, 0052). A client never stands: peers it did not
    /// dial cannot reach it (decision 0066).
    pub(super) fn elected(&self, view: &View<'_>) -> Option<PeerId> {
        let sync = &self.sync;
        let (open, pinned) = sync.mode.elastic().map_or((false, None), |elastic| {
            (elastic.election == Election::Open, elastic.center)
        });
        let client = |p: &PeerId| view.peers.get(p).is_some_and(|v| v.client);
        let stands =
            |p: &PeerId| !client(p) && (open || sync.trust.contains(p) || pinned == Some(*p));
        let mut live: Vec<(PeerId, Vec<u8>)> = self
            .coupled(view)
            .into_iter()
            .filter(stands)
            .map(|p| (p, p.to_bytes()))
            .collect();
        if !self.joining && !view.peers.is_client() {
            live.push((self.me, self.me.to_bytes()));
        }
        let configured = pinned.map(|p| p.to_bytes());
        elect_center(&live, &self.run_id, configured.as_deref())
    }

    pub(super) fn on_center_seeded(&mut self, ok: bool, view: &View<'_>) -> Vec<Action> {
        let me = self.me;
        let Some(elastic) = self.center.as_mut() else {
            return Vec::new();
        };
        elastic.seeding = false;
        if !ok || elastic.center() != Some(me) {
            return self.elect(view);
        }
        elastic.holds = true;
        let version = elastic.tracker.version();
        self.role = Role::Center;
        info!(version, "this node holds the elastic center");
        vec![Action::Publish(self.view())]
    }
}
