//! Compressed pairwise exchanges (CHOCO-gossip): for every partner, a copy of this replica as
//! the partner knows it (`own`) and a copy of the partner's (`theirs`), both built only from the
//! compressed differences the two have sent each other, so that both sides hold the same two
//! copies. An exchange sends `Q(x - own)`; both sides add what was sent to the copy it belongs
//! to; the replica then moves by `weight (theirs - own)`. What `Q` loses stays in `x - own` and
//! goes out in the next exchange (error feedback).
//!
//! The copies carry a version, the number of exchanges both sides completed. An exchange says the
//! version it was computed against; when the two sides disagree (one side completed an exchange
//! the other did not, or a side restarted), both start again from zero copies.
//!
//! The copies are sans IO; the daemon's engine keeps every partner's in a [`CopyBook`], which
//! lends a pair's copies to one exchange at a time.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use libp2p_identity::PeerId;
use murmur_protocol::codec::Codec;
use murmur_protocol::mix;

/// How long an answered compressed offer waits for the pair's copies, which our own offer to
/// the same peer may hold (offers that crossed: the peer declines ours, one round trip later;
/// decision 0021).
pub const CROSSING_WAIT: Duration = Duration::from_secs(2);

/// The two copies of one pair.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Copies {
    /// Exchanges the pair completed on these copies.
    pub version: u64,
    pub own: Vec<f32>,
    pub theirs: Vec<f32>,
}

impl Copies {
    /// Zero copies: a pair that has not exchanged yet, or starts again.
    pub fn fresh(len: usize) -> Self {
        Copies {
            version: 0,
            own: vec![0.0; len],
            theirs: vec![0.0; len],
        }
    }

    /// The version an exchange runs against: these copies' if the partner names the same,
    /// else zero copies (both sides start again).
    pub fn agree(&mut self, theirs: Option<u64>) -> u64 {
        if theirs != Some(self.version) {
            *self = Copies::fresh(self.own.len());
        }
        self.version
    }

    /// What this side sends: `Q(params - own)` encoded, and the values the partner decodes.
    pub fn difference(&self, codec: Codec, params: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let diff: Vec<f32> = params.iter().zip(&self.own).map(|(x, c)| x - c).collect();
        let encoded = codec.encode(&diff);
        // The encoder's own output always decodes (finite in, finite out).
        let sent = codec.decode(&encoded, diff.len()).unwrap_or(diff);
        (encoded, sent)
    }

    /// The partner's copy once its difference `received` is added.
    pub fn theirs_after(&self, received: &[f32]) -> Vec<f32> {
        self.theirs
            .iter()
            .zip(received)
            .map(|(c, d)| c + d)
            .collect()
    }

    /// How far apart the two copies are once the exchange's differences are added (`sent` to
    /// `own`, `theirs` already summed): the gap the consensus step closes, and so what an
    /// exchange is judged by. Both sides compute the same gap. The distance from the partner's
    /// copy to this replica would also count how far the copy lags: with top-k a copy takes
    /// many exchanges to catch up, and a pair judged by that lag declined, kept its copies
    /// behind, and so declined again (decision 0034).
    pub fn gap_after(&self, sent: &[f32], theirs: &[f32]) -> f64 {
        let own: Vec<f32> = self.own.iter().zip(sent).map(|(c, d)| c + d).collect();
        mix::distance(theirs, &own)
    }

    /// Both sides completed the exchange: the copies take the two differences.
    pub fn commit(&mut self, sent: &[f32], theirs: Vec<f32>) {
        self.own.iter_mut().zip(sent).for_each(|(c, d)| *c += d);
        self.theirs = theirs;
        self.version += 1;
    }
}

/// Every partner's copies, each pair's lent to one exchange at a time: two exchanges of a pair
/// at once would each commit a version of the copies that the other does not know, and the
/// pair would start again from zero at its next exchange.
#[derive(Debug, Default)]
pub struct CopyBook {
    /// The copies no exchange holds.
    copies: HashMap<PeerId, Copies>,
    /// The partners whose copies an exchange holds.
    lent: HashSet<PeerId>,
}

impl CopyBook {
    /// Lends `peer`'s copies to an exchange of a model of `len` values (fresh ones if there
    /// are none, or none of that length), or `None` while another exchange holds them.
    pub fn lend(&mut self, peer: PeerId, len: usize) -> Option<Copies> {
        if !self.lent.insert(peer) {
            return None;
        }
        let copies = self
            .copies
            .remove(&peer)
            .filter(|copies| copies.own.len() == len)
            .unwrap_or_else(|| Copies::fresh(len));
        Some(copies)
    }

    /// An exchange gives `peer`'s copies back, as it left them: the next exchange of the pair
    /// may take them.
    pub fn give_back(&mut self, peer: PeerId, copies: Copies) {
        self.lent.remove(&peer);
        self.copies.insert(peer, copies);
    }
}

/// `other` such that `other - snapshot = scale (theirs - own)`, `scale` the codec's
/// [`Codec::consensus_scale`]: a replica that mixes `x + weight (other - snapshot)` takes
/// CHOCO's consensus step `x + weight scale (theirs - own)`.
pub fn mixed_other(codec: Codec, theirs: &[f32], own: &[f32], snapshot: &[f32]) -> Vec<f32> {
    let scale = codec.consensus_scale();
    theirs
        .iter()
        .zip(own)
        .zip(snapshot)
        .map(|((t, o), s)| s + scale * (t - o))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_lends_its_copies_to_one_exchange_at_a_time() {
        let mut book = CopyBook::default();
        let (p, q) = (PeerId::random(), PeerId::random());
        let mut copies = book.lend(p, 3).expect("nothing holds p's copies");
        assert_eq!(
            copies,
            Copies::fresh(3),
            "a first exchange starts from zero"
        );
        assert!(book.lend(p, 3).is_none(), "a second exchange with p waits");
        assert!(book.lend(q, 3).is_some(), "other peers are free");
        copies.commit(&[1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]);
        book.give_back(p, copies);
        let copies = book.lend(p, 3).expect("given back");
        assert_eq!(copies.version, 1);
        assert_eq!(copies.own, vec![1.0, 2.0, 3.0]);
        // Copies of another model's length are of no use: fresh ones.
        book.give_back(p, copies);
        assert_eq!(book.lend(p, 4), Some(Copies::fresh(4)));
    }

    /// Two replicas that agree, meeting on fresh copies (their first top-k exchange, or the
    /// first after a side restarted): the gap the mix would close is nil, though the partner's
    /// copy is still far from this replica. A partner whose difference would move us far is
    /// still seen as far.
    #[test]
    fn an_exchange_is_judged_by_the_gap_between_the_copies_not_by_how_far_they_lag() {
        let codec = Codec::TopK { per_mille: 50 };
        let replica: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.1).sin()).collect();
        let copies = Copies::fresh(replica.len());
        let (_, sent) = copies.difference(codec, &replica);
        let (_, received) = copies.difference(codec, &replica);
        let theirs = copies.theirs_after(&received);
        let lag = mix::distance(&theirs, &replica);
        assert!(lag > 0.5 * mix::norm(&replica), "lag {lag}");
        assert_eq!(copies.gap_after(&sent, &theirs), 0.0);

        let hostile: Vec<f32> = received.iter().map(|d| d * 1e3).collect();
        let theirs = copies.theirs_after(&hostile);
        assert!(copies.gap_after(&sent, &theirs) > 10.0 * mix::norm(&replica));
    }

    /// Two replicas that exchange int8, int4 or top-k differences of their copies converge to their
    /// mean, however coarse each message is: the copies catch up (error feedback) and the
    /// mixing keeps the pair's sum.
    #[test]
    fn two_replicas_mixing_through_compressed_copies_meet_at_their_mean() {
        for (codec, rounds) in [
            (Codec::INT8, 12),
            (Codec::INT4, 24),
            (Codec::TopK { per_mille: 100 }, 60),
        ] {
            mix_through_copies(codec, rounds);
        }
    }

    fn mix_through_copies(codec: Codec, rounds: usize) {
        let n = 1000;
        let mut a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).sin()).collect();
        let mut b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.07).cos() * 2.0).collect();
        let mean: Vec<f32> = a.iter().zip(&b).map(|(x, y)| (x + y) / 2.0).collect();
        let (mut at_a, mut at_b) = (Copies::fresh(n), Copies::fresh(n));
        for _ in 0..rounds {
            let (_, from_a) = at_a.difference(codec, &a);
            let (_, from_b) = at_b.difference(codec, &b);
            let theirs_a = at_a.theirs_after(&from_b);
            let theirs_b = at_b.theirs_after(&from_a);
            at_a.commit(&from_a, theirs_a);
            at_b.commit(&from_b, theirs_b);
            assert_eq!(at_a.own, at_b.theirs, "both sides hold the same copies");
            let step = 0.5 * codec.consensus_scale();
            for i in 0..n {
                a[i] += step * (at_a.theirs[i] - at_a.own[i]);
                b[i] += step * (at_b.theirs[i] - at_b.own[i]);
            }
        }
        let worst = |x: &[f32]| {
            x.iter()
                .zip(&mean)
                .fold(0.0f32, |m, (v, t)| m.max((v - t).abs()))
        };
        assert!(
            worst(&a) < 1e-3 && worst(&b) < 1e-3,
            "{codec:?}: {} {}",
            worst(&a),
            worst(&b)
        );
    }
}
