//! The tally of a quorum round: node answers counted as they come, and the verdict they
//! give, as soon as the nodes not heard from can no longer change it.
//!
//! The one place where node answers are counted, for every operation: acquisition
//! ([`Rule::Acquire`]), extension, release and the fencing write ([`Rule::Held`]).

/// How one node's answer counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Vote {
    /// The node did what was asked (`SET NX` took, the token was there).
    For,
    /// The node answered against (the key is held by another, or our token is gone).
    Against,
}

impl Vote {
    /// For when `agrees`, else against.
    pub(super) fn of(agrees: bool) -> Self {
        if agrees { Vote::For } else { Vote::Against }
    }
}

/// What the answers of a round say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QuorumVerdict {
    /// A quorum voted for.
    Won,
    /// The answers rule the operation out.
    Lost,
    /// The answers in time decide nothing: too many nodes failed.
    NoQuorum,
}

/// The answers counted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tally {
    /// Answers that voted for.
    pub(super) won: usize,
    /// Answers that voted against.
    pub(super) against: usize,
    /// Nodes that failed or did not answer in time.
    pub(super) failed: usize,
    /// Nodes not heard from yet.
    pub(super) pending: usize,
}

impl Tally {
    /// Nothing heard yet from `nodes` nodes.
    pub(super) fn new(nodes: usize) -> Self {
        Self {
            pending: nodes,
            ..Self::default()
        }
    }

    /// Counts one node's answer: its vote, or `None` when it failed.
    pub(super) fn record(&mut self, vote: Option<Vote>) {
        self.pending = self.pending.saturating_sub(1);
        match vote {
            Some(Vote::For) => self.won += 1,
            Some(Vote::Against) => self.against += 1,
            None => self.failed += 1,
        }
    }

    fn nodes(&self) -> usize {
        self.won + self.against + self.failed + self.pending
    }

    /// The verdict under `rule` once the answers so far decide it; `None` while pending
    /// nodes could still change it (never once nothing is pending).
    pub(super) fn verdict(&self, quorum: usize, rule: Rule) -> Option<QuorumVerdict> {
        if self.won >= quorum {
            return Some(QuorumVerdict::Won);
        }
        let can_win = self.won + self.pending >= quorum;
        match rule {
            Rule::Acquire => {
                let answered = self.won + self.against;
                if can_win {
                    None
                } else if answered >= quorum {
                    Some(QuorumVerdict::Lost)
                } else if answered + self.pending < quorum {
                    Some(QuorumVerdict::NoQuorum)
                } else {
                    None
                }
            }
            Rule::Held => {
                // Against on N - quorum + 1 nodes: the rest cannot make a quorum.
                let proof = self.nodes().saturating_sub(quorum) + 1;
                if self.against >= proof {
                    Some(QuorumVerdict::Lost)
                } else if !can_win && self.against + self.pending < proof {
                    Some(QuorumVerdict::NoQuorum)
                } else {
                    None
                }
            }
        }
    }
}

/// What it takes for a round to be lost rather than without a quorum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rule {
    /// An acquisition: lost once a quorum of nodes answered and the votes for can no
    /// longer reach a quorum; with fewer answers, no quorum.
    Acquire,
    /// An operation on a held lease: lost only once N - quorum + 1 nodes voted against
    /// (the token cannot be on a quorum); else, with failed nodes, no quorum.
    Held,
}

#[cfg(test)]
mod tests {
    use super::*;
    use QuorumVerdict::{Lost, NoQuorum};

    /// A tally of `won`, `against` and `failed` answers, `pending` nodes not heard from.
    fn tally(won: usize, against: usize, failed: usize, pending: usize) -> Tally {
        Tally {
            won,
            against,
            failed,
            pending,
        }
    }

    const RULES: [Rule; 2] = [Rule::Acquire, Rule::Held];

    /// Every `(a, b, c)` with `a + b + c == n`.
    fn splits(n: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..=n).flat_map(move |a| (0..=n - a).map(move |b| (a, b, n - a - b)))
    }

    #[test]
    fn a_quorum_of_votes_wins_whatever_is_pending() {
        for rule in RULES {
            assert_eq!(tally(2, 0, 0, 1).verdict(2, rule), Some(QuorumVerdict::Won));
            assert_eq!(tally(3, 1, 1, 0).verdict(3, rule), Some(QuorumVerdict::Won));
            assert_eq!(tally(1, 0, 0, 0).verdict(1, rule), Some(QuorumVerdict::Won));
        }
    }

    /// `((won, against, failed, pending), quorum, expected verdict)`.
    type Case = ((usize, usize, usize, usize), usize, Option<QuorumVerdict>);

    fn check(rule: Rule, cases: &[Case]) {
        for &((w, a, f, p), quorum, expected) in cases {
            let got = tally(w, a, f, p).verdict(quorum, rule);
            assert_eq!(got, expected, "{w}/{a}/{f}/{p}, quorum {quorum}, {rule:?}");
        }
    }

    #[test]
    fn taken_needs_a_quorum_of_answers() {
        check(
            Rule::Acquire,
            &[
                // 5 nodes, 3 killed: two "held" answers decide nothing.
                ((0, 2, 3, 0), 3, Some(NoQuorum)),
                // Two held, one failed, two to come: whether a quorum answers is unknown.
                ((0, 2, 1, 2), 3, None),
                ((0, 3, 1, 1), 3, Some(Lost)),
                // 3 nodes, one hung: two held answers are a quorum of answers.
                ((0, 2, 0, 1), 2, Some(Lost)),
                // One OK, one held, the third could still be an OK.
                ((1, 1, 0, 1), 2, None),
                // A quorum answered; with the failed node's OK it still would not win.
                ((1, 2, 1, 0), 3, Some(Lost)),
                // A quorum answered without a quorum of OKs: taken, although the failed
                // node's OK would have made one.
                ((1, 1, 1, 0), 2, Some(Lost)),
                ((1, 0, 2, 0), 2, Some(NoQuorum)),
            ],
        );
    }

    #[test]
    fn expired_needs_n_minus_quorum_plus_one_answers_against() {
        check(
            Rule::Held,
            &[
                // 5 nodes: token on 2, gone on 2, one unreachable that may hold it.
                ((2, 2, 1, 0), 3, Some(NoQuorum)),
                ((2, 2, 0, 1), 3, None),
                // Gone on 3 of 5, 2 of 3: proof, whatever the rest say.
                ((0, 3, 0, 2), 3, Some(Lost)),
                ((1, 3, 1, 0), 3, Some(Lost)),
                ((0, 2, 0, 1), 2, Some(Lost)),
                // 3 nodes: gone on 1, one failed, one holds: no proof either way.
                ((1, 1, 1, 0), 2, Some(NoQuorum)),
                // 4 nodes, quorum 3: gone on 2 leaves at most 2.
                ((1, 2, 0, 1), 3, Some(Lost)),
                // 1 node.
                ((0, 1, 0, 0), 1, Some(Lost)),
                ((0, 0, 1, 0), 1, Some(NoQuorum)),
            ],
        );
    }

    #[test]
    fn undecided_while_pending_nodes_could_still_change_it() {
        for rule in RULES {
            assert_eq!(tally(1, 0, 0, 2).verdict(2, rule), None);
            assert_eq!(tally(1, 1, 0, 1).verdict(2, rule), None);
            assert_eq!(tally(2, 1, 0, 2).verdict(3, rule), None);
        }
    }

    #[test]
    fn every_tally_has_one_verdict_once_nothing_is_pending() {
        for nodes in 1..=7 {
            let quorum = nodes / 2 + 1;
            for (won, against, failed) in splits(nodes) {
                for rule in RULES {
                    let lost = match rule {
                        Rule::Acquire => won + against >= quorum,
                        Rule::Held => against > nodes - quorum,
                    };
                    let expected = if won >= quorum {
                        QuorumVerdict::Won
                    } else if lost {
                        Lost
                    } else {
                        NoQuorum
                    };
                    let verdict = tally(won, against, failed, 0).verdict(quorum, rule);
                    let case = format!("{won}/{against}/{failed} of {nodes}, {rule:?}");
                    assert_eq!(verdict, Some(expected), "{case}");
                }
            }
        }
    }

    #[test]
    fn an_early_verdict_is_the_one_the_pending_nodes_cannot_change() {
        for nodes in 1..=5 {
            let quorum = nodes / 2 + 1;
            for pending in 0..=nodes {
                for (won, against, failed) in splits(nodes - pending) {
                    for rule in RULES {
                        let early = tally(won, against, failed, pending).verdict(quorum, rule);
                        let Some(early) = early else { continue };
                        // Whatever the pending nodes answer, the verdict stays.
                        for (w, a, f) in splits(pending) {
                            let last = tally(won + w, against + a, failed + f, 0);
                            assert_eq!(last.verdict(quorum, rule), Some(early), "{rule:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn record_moves_a_node_from_pending() {
        let mut t = Tally::new(3);
        t.record(Some(Vote::For));
        t.record(Some(Vote::Against));
        t.record(None);
        assert_eq!(t, tally(1, 1, 1, 0));
    }
}
