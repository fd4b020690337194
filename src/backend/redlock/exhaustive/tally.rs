//! Every sequence of answers on 1 to 7 nodes, for each operation: the tally's verdict
//! after every arrival is the one the model makes due, and a won round gives a lease only
//! when validity is left at the arrival that decided it.
//!
//! The tally has no notion of which node answered (`Tally::record` takes a vote), so the
//! sequences of answers cover every assignment of answers to nodes in every order of
//! arrival: on 5 nodes, 6^5 = 7,776 sequences stand for the 6^5 × 5! = 933,120 pairs of
//! an assignment and an order. The round, which does know the nodes, is driven in every
//! order in [`super::round`].

use std::time::Duration;

use super::{ANSWERS, NodeAnswer, OPS, Op, due, possible};
use crate::backend::redlock::tally::{QuorumVerdict, Tally};
use crate::backend::redlock::validity;

/// A lease's TTL and the drift allowance, as the builder makes them for a 10 s TTL.
const TTL: Duration = Duration::from_secs(10);
const DRIFT: Duration = Duration::from_millis(102);

/// What an operation ends with, as its caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallerOutcome {
    /// Acquired, extended, released.
    Granted,
    /// A quorum, but no validity left (`LockError::TooSlow`).
    TooSlow,
    /// Taken (acquire) or expired (extend, release).
    Refused,
    NoQuorum,
}

/// How long after the round started the answer at `index` of `answers` arrived: just
/// inside the validity before the first late answer, and from the last instant of it on
/// (the validity is exactly used up at the first late arrival).
fn elapsed_at(answers: &[NodeAnswer], index: usize) -> Duration {
    let validity_end = TTL - DRIFT;
    match answers.iter().position(|a| *a == NodeAnswer::Late) {
        Some(late) if index >= late => validity_end + Duration::from_millis((index - late) as u64),
        _ => validity_end - Duration::from_nanos((answers.len() - index) as u64),
    }
}

/// What the caller gets from the code: the tally's verdict, and for an operation that
/// makes a lease, the validity left when the round returned (the glue of
/// `Acquisition::won` and `Redlock::extend_untraced`, restated: a won round without
/// validity is `TooSlow`).
fn code_outcome(op: Op, verdict: QuorumVerdict, elapsed: Duration) -> CallerOutcome {
    match verdict {
        QuorumVerdict::Won if op.needs_validity() => match validity(TTL, DRIFT, elapsed) {
            Some(_) => CallerOutcome::Granted,
            None => CallerOutcome::TooSlow,
        },
        QuorumVerdict::Won => CallerOutcome::Granted,
        QuorumVerdict::Lost => CallerOutcome::Refused,
        QuorumVerdict::NoQuorum => CallerOutcome::NoQuorum,
    }
}

/// What the rules say the caller gets: a lease only with a quorum and validity left at
/// the arrival that decided the round, which came before any late answer.
fn model_outcome(
    op: Op,
    verdict: QuorumVerdict,
    answers: &[NodeAnswer],
    decided_at: usize,
) -> CallerOutcome {
    let in_time = !answers[..=decided_at].contains(&NodeAnswer::Late);
    match verdict {
        QuorumVerdict::Won if op.needs_validity() && !in_time => CallerOutcome::TooSlow,
        QuorumVerdict::Won => CallerOutcome::Granted,
        QuorumVerdict::Lost => CallerOutcome::Refused,
        QuorumVerdict::NoQuorum => CallerOutcome::NoQuorum,
    }
}

/// Counts of what a walk checked.
#[derive(Debug, Default)]
struct TallyCoverage {
    /// Complete sequences of answers.
    sequences: u64,
    /// Verdicts checked after an arrival (and before the first).
    verdicts: u64,
}

/// Walks every continuation of `arrived` on `nodes` nodes: after each arrival, the
/// tally's verdict is the model's due verdict; once complete, the outcome is the model's.
fn walk(
    op: Op,
    nodes: usize,
    arrived: &mut Vec<NodeAnswer>,
    tally: Tally,
    decided: Option<(usize, QuorumVerdict)>,
    checked: &mut TallyCoverage,
) {
    let quorum = nodes / 2 + 1;
    let pending = nodes - arrived.len();
    let verdict = tally.verdict(quorum, op.rule());
    let expected = due(possible(op, &mut arrived.clone(), pending));
    assert_eq!(
        verdict, expected,
        "{op:?} on {nodes} nodes after {arrived:?}: the tally's verdict (left) is not the one \
         the rules make due (right): due iff no answers of the {pending} pending nodes could \
         change it"
    );
    checked.verdicts += 1;
    let decided = decided.or(verdict.map(|v| (arrived.len().saturating_sub(1), v)));
    if pending == 0 {
        let (at, verdict) = decided.expect("a complete round has a verdict");
        let got = code_outcome(op, verdict, elapsed_at(arrived, at));
        let want = model_outcome(op, verdict, arrived, at);
        assert_eq!(
            got, want,
            "{op:?} on {nodes} nodes: {arrived:?}, decided at arrival {at}: the code's outcome \
             (left) is not the rules' (right)"
        );
        checked.sequences += 1;
        return;
    }
    for answer in ANSWERS {
        let mut next = tally;
        next.record(op.vote(answer));
        arrived.push(answer);
        walk(op, nodes, arrived, next, decided, checked);
        arrived.pop();
    }
}

/// Every sequence of answers on `nodes` nodes, for every operation.
fn check_every_sequence(nodes: usize) -> TallyCoverage {
    let mut checked = TallyCoverage::default();
    for op in OPS {
        walk(
            op,
            nodes,
            &mut Vec::new(),
            Tally::new(nodes),
            None,
            &mut checked,
        );
    }
    let per_op = 6u64.pow(nodes as u32);
    assert_eq!(checked.sequences, 3 * per_op, "every sequence was walked");
    checked
}

#[test]
fn every_sequence_of_answers_on_1_to_6_nodes_gets_the_verdict_the_rules_give_as_soon_as_due() {
    for nodes in 1..=6 {
        let checked = check_every_sequence(nodes);
        eprintln!("{nodes} nodes: {checked:?}");
    }
}

/// 3 × 6^7 = 839,808 sequences: about a second unoptimised, so run by `scripts/exhaustive`.
#[test]
#[ignore = "about a second; run by scripts/exhaustive"]
fn every_sequence_of_answers_on_7_nodes_gets_the_verdict_the_rules_give_as_soon_as_due() {
    let checked = check_every_sequence(7);
    eprintln!("7 nodes: {checked:?}");
}

#[test]
fn validity_is_positive_only_inside_the_ttl_less_the_drift() {
    let edge = TTL - DRIFT;
    assert_eq!(
        validity(TTL, DRIFT, edge - Duration::from_nanos(1)),
        Some(Duration::from_nanos(1))
    );
    assert_eq!(validity(TTL, DRIFT, edge), None);
    assert_eq!(validity(TTL, DRIFT, TTL), None);
    assert_eq!(validity(TTL, DRIFT, Duration::MAX), None);
    assert_eq!(validity(Duration::ZERO, DRIFT, Duration::ZERO), None);
    assert_eq!(validity(TTL, Duration::MAX, Duration::ZERO), None);
    assert_eq!(
        validity(Duration::MAX, Duration::ZERO, Duration::ZERO),
        Some(Duration::MAX)
    );
}
