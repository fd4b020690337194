//! Exhaustive checks of the quorum verdicts, against a model written from the rules of
//! the module docs ([`super`]) rather than from the tally's code.
//!
//! The model knows only what a complete round says: a quorum of votes for wins; an
//! acquisition is lost (`Taken`) once a quorum of nodes answered without a quorum of
//! OKs; an operation on a held lease is lost (`Expired`) once N - quorum + 1 nodes
//! answered against; anything else is no quorum. What a partial round says is derived from
//! that alone: a verdict is due exactly when every way the nodes not heard from could
//! answer gives the same complete verdict ([`possible`]).
//!
//! - [`tally`]: every sequence of answers on 1 to 6 nodes (7 in the ignored run), each
//!   answer mapped to its vote by the operation's own reply type and vote function, the
//!   verdict checked after every arrival, and the validity left at the deciding arrival.
//! - [`round`]: the round itself ([`super::round::run`]) on 1, 3 and 5 nodes, driven
//!   answer by answer: it returns at the arrival the model says decides, and at the
//!   deadline it counts the nodes that never answered as failed. On 5 nodes the suite
//!   drives one order in 12; the ignored run drives every order.
//!
//! `scripts/exhaustive` runs the ignored, larger variants.

mod round;
mod tally;

use std::time::Duration;

use super::acquire::took;
use super::scripts::{Attempted, ReleaseReply};
use super::tally::{QuorumVerdict, Rule, Vote};
use super::{deleted, extended};
use crate::error::NodeFailureReason;

/// One node's answer, as the checks name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NodeAnswer {
    /// The node did what was asked: `SET NX` took (acquire), our token was there (extend,
    /// release).
    Done,
    /// Another holder has the key, with a TTL.
    HeldByOther,
    /// The key is gone (acquire: free, but not ours to take, as behind a fair queue).
    Gone,
    /// The node answered with an error.
    Error,
    /// The node did not answer before the deadline.
    Timeout,
    /// [`Done`](NodeAnswer::Done), arriving once the validity has run out: this arrival and
    /// every later one come too late for a lease.
    Late,
}

pub(super) const ANSWERS: [NodeAnswer; 6] = [
    NodeAnswer::Done,
    NodeAnswer::HeldByOther,
    NodeAnswer::Gone,
    NodeAnswer::Error,
    NodeAnswer::Timeout,
    NodeAnswer::Late,
];

/// The operations whose rounds are checked, each through its real reply type and vote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    /// `SET NX` ([`took`]), under [`Rule::Acquire`].
    Acquire,
    /// The extension script ([`extended`]), under [`Rule::Held`]; the lease's validity is
    /// recomputed.
    Extend,
    /// The release script ([`deleted`]), under [`Rule::Held`].
    Release,
}

pub(super) const OPS: [Op; 3] = [Op::Acquire, Op::Extend, Op::Release];

/// A node's failure, as a round records an error.
fn failure() -> NodeFailureReason {
    NodeFailureReason::NotAcknowledged {
        replicas: 0,
        wanted: 1,
        fsynced: false,
    }
}

/// A node's reply to an acquisition: what the acquisition script decodes to.
pub(super) fn acquire_reply(answer: NodeAnswer) -> Result<Attempted, NodeFailureReason> {
    match answer {
        NodeAnswer::Done | NodeAnswer::Late => Ok(Attempted::Set(0)),
        NodeAnswer::HeldByOther => Ok(Attempted::Held { pttl_ms: 7_000 }),
        NodeAnswer::Gone => Ok(Attempted::Held { pttl_ms: -2 }),
        NodeAnswer::Error => Err(failure()),
        NodeAnswer::Timeout => Err(NodeFailureReason::Timeout(Duration::from_millis(50))),
    }
}

/// A node's reply to an extension: the script's 1, 0 or -1.
pub(super) fn extend_reply(answer: NodeAnswer) -> Result<i64, NodeFailureReason> {
    match answer {
        NodeAnswer::Done | NodeAnswer::Late => Ok(1),
        NodeAnswer::HeldByOther => Ok(-1),
        NodeAnswer::Gone => Ok(0),
        NodeAnswer::Error => Err(failure()),
        NodeAnswer::Timeout => Err(NodeFailureReason::Timeout(Duration::from_millis(50))),
    }
}

/// A node's reply to a release.
pub(super) fn release_reply(answer: NodeAnswer) -> Result<ReleaseReply, NodeFailureReason> {
    match answer {
        NodeAnswer::Done | NodeAnswer::Late => Ok(ReleaseReply::Deleted),
        NodeAnswer::HeldByOther => Ok(ReleaseReply::HeldByOther),
        NodeAnswer::Gone => Ok(ReleaseReply::Absent),
        NodeAnswer::Error => Err(failure()),
        NodeAnswer::Timeout => Err(NodeFailureReason::Timeout(Duration::from_millis(50))),
    }
}

impl Op {
    /// The rule the operation's round is decided by, as the code passes it.
    pub(super) fn rule(self) -> Rule {
        match self {
            Op::Acquire => Rule::Acquire,
            Op::Extend | Op::Release => Rule::Held,
        }
    }

    /// How the code counts `answer`: the operation's vote function on the reply, `None`
    /// for a failure.
    pub(super) fn vote(self, answer: NodeAnswer) -> Option<Vote> {
        match self {
            Op::Acquire => acquire_reply(answer).ok().map(|reply| took(&reply)),
            Op::Extend => extend_reply(answer).ok().map(|reply| extended(&reply)),
            Op::Release => release_reply(answer).ok().map(|reply| deleted(&reply)),
        }
    }

    /// Whether a won round still needs validity left (a lease comes out of it).
    pub(super) fn needs_validity(self) -> bool {
        matches!(self, Op::Acquire | Op::Extend)
    }
}

/// The verdict the rules give a complete round of `answers` (nothing pending).
pub(super) fn rules(op: Op, answers: &[NodeAnswer]) -> QuorumVerdict {
    let nodes = answers.len();
    let quorum = nodes / 2 + 1;
    let count = |wanted: &[NodeAnswer]| answers.iter().filter(|a| wanted.contains(a)).count();
    let ok = count(&[NodeAnswer::Done, NodeAnswer::Late]);
    let against = count(&[NodeAnswer::HeldByOther, NodeAnswer::Gone]);
    if ok >= quorum {
        return QuorumVerdict::Won;
    }
    let lost = match op {
        // Taken: a quorum of nodes answered, and their OKs are no quorum.
        Op::Acquire => ok + against >= quorum,
        // Expired: the token is missing on N - quorum + 1 nodes, so no quorum holds it.
        Op::Extend | Op::Release => against > nodes - quorum,
    };
    if lost {
        QuorumVerdict::Lost
    } else {
        QuorumVerdict::NoQuorum
    }
}

/// The complete verdicts that `pending` more answers after `arrived` can lead to, as a
/// set (bit 0 won, 1 lost, 2 no quorum).
pub(super) fn possible(op: Op, arrived: &mut Vec<NodeAnswer>, pending: usize) -> u8 {
    if pending == 0 {
        return bit(rules(op, arrived));
    }
    let mut set = 0;
    // Only the answers' votes matter to the rules: one answer of each vote stands for
    // the others (a sequence of every answer is checked in `tally`).
    for answer in [NodeAnswer::Done, NodeAnswer::HeldByOther, NodeAnswer::Error] {
        arrived.push(answer);
        set |= possible(op, arrived, pending - 1);
        arrived.pop();
        if set.count_ones() > 1 {
            break;
        }
    }
    set
}

pub(super) fn bit(verdict: QuorumVerdict) -> u8 {
    match verdict {
        QuorumVerdict::Won => 1,
        QuorumVerdict::Lost => 2,
        QuorumVerdict::NoQuorum => 4,
    }
}

/// The verdict a set of [`possible`] verdicts makes due: its one member, if it has one.
pub(super) fn due(set: u8) -> Option<QuorumVerdict> {
    match set {
        1 => Some(QuorumVerdict::Won),
        2 => Some(QuorumVerdict::Lost),
        4 => Some(QuorumVerdict::NoQuorum),
        _ => None,
    }
}
