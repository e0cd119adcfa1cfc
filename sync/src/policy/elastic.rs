//! Elastic averaging around a center: the election, the center's seeding, requests to it.

use super::*;

impl Policy {
    /// Elastic worker: the due snapshot goes to the center (or, at the center, to its own
    /// center variable).
    pub(super) fn ask_center(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(center) = self.tracker.center().copied() else {
            return self.release();
        };
        if center == self.me {
            if !self.holds_center {
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
            screen: self.deltas.screen(view.now),
        }]
    }

    pub(super) fn on_center_answer(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        match outcome {
            Outcome::Mixed { distance, credited } => {
                self.deltas.accepted(peer, distance, credited, view.now);
                self.mixed = true;
                self.due = None;
                return actions;
            }
            // The center is the one source of deltas.
            Outcome::Outlier { distance } => {
                self.deltas.outlier(peer, distance, 1);
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
        let mut actions = Vec::new();
        if let Some(version) = self.tracker.update(elected) {
            if elected != Some(self.me) {
                if self.holds_center {
                    actions.push(Action::DropCenter);
                }
                self.holds_center = false;
                if self.role == Role::Center {
                    self.role = Role::Worker;
                }
                match elected {
                    Some(center) => info!(center = %center, version, "elastic center elected"),
                    None => info!(version, "no elastic center while alone"),
                }
            }
            actions.push(Action::Publish(self.view()));
        }
        if elected == Some(self.me) && !self.holds_center && !self.seeding {
            self.seeding = true;
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
        self.seeding = false;
        if !ok || self.tracker.center() != Some(&self.me) {
            return self.elect(view);
        }
        self.holds_center = true;
        self.role = Role::Center;
        info!(
            version = self.tracker.version(),
            "this node holds the elastic center"
        );
        vec![Action::Publish(self.view())]
    }
}
