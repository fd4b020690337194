//! The quorum round: one operation sent to every node at once under one deadline, the
//! answers tallied as they come, and a verdict as soon as they decide it.
//!
//! [`Tally`] is the one place where node answers are counted; [`run`] drives the node
//! operations and stops waiting once the tally has a verdict, finishing or dropping the
//! stragglers as the caller asks.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::NodeFailureReason;

/// How one node's answer counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Vote {
    /// The node did what was asked (`SET NX` took, the token was there).
    For,
    /// The node answered, and the answer is against (the key is held by another, or our
    /// token is gone).
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
pub(super) enum Verdict {
    /// A quorum voted for.
    Won,
    /// The answers rule the operation out.
    Lost,
    /// The answers in time decide nothing: too many nodes failed.
    NoQuorum,
}

/// What to do with the nodes still answering once the verdict is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stragglers {
    /// Do not decide early: wait for every node, up to the deadline.
    Await,
    /// Return at the verdict and stop waiting for the rest.
    Drop,
    /// Return at the verdict and finish the rest in the background, up to the deadline
    /// (writes that must land, such as releases).
    Finish,
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

    /// The verdict under `rule`, once the answers so far decide it (whatever the pending
    /// nodes say); `None` while they could still change it. Always `Some` once nothing
    /// is pending.
    pub(super) fn verdict(&self, quorum: usize, rule: Rule) -> Option<Verdict> {
        if self.won >= quorum {
            return Some(Verdict::Won);
        }
        let can_win = self.won + self.pending >= quorum;
        match rule {
            Rule::Contest => {
                let answered = self.won + self.against;
                if can_win {
                    None
                } else if answered >= quorum {
                    Some(Verdict::Lost)
                } else if answered + self.pending < quorum {
                    Some(Verdict::NoQuorum)
                } else {
                    None
                }
            }
            Rule::Proof => {
                // Against on N - quorum + 1 nodes: the rest cannot make a quorum.
                let proof = self.nodes().saturating_sub(quorum) + 1;
                if self.against >= proof {
                    Some(Verdict::Lost)
                } else if !can_win && self.against + self.pending < proof {
                    Some(Verdict::NoQuorum)
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
    /// An acquisition: lost (the lock is taken) once at least a quorum of nodes answered
    /// and the votes for can no longer reach a quorum. With fewer answers, whatever they
    /// said, nothing is known about the lock: no quorum.
    Contest,
    /// An operation on a held lease (extend, release, the fencing write): lost (the lease
    /// is gone) only once N - quorum + 1 nodes voted against, so that the token cannot
    /// be on a quorum; when the nodes that failed could still hold it, no quorum.
    Proof,
}

/// Every node's answer in node order (`None` for a node whose answer was not awaited),
/// and the verdict they gave.
pub(super) struct Answers<T> {
    pub(super) verdict: Verdict,
    pub(super) answers: Vec<Option<Result<T, NodeFailureReason>>>,
}

impl<T> Answers<T> {
    /// The answers that came, in node order, without the failures.
    pub(super) fn values(&self) -> impl Iterator<Item = &T> {
        self.answers
            .iter()
            .filter_map(|a| a.as_ref()?.as_ref().ok())
    }
}

/// Runs `ops` (one per node, all started at once, so one timer bounds them all) and
/// tallies their answers with `vote`.
///
/// Unless `stragglers` is [`Stragglers::Await`], returns as soon as the tally has a
/// verdict: a hung node then costs nothing while the others decide.
///
/// The operations are taken from `ops` before the returned future is first polled, so
/// that the future holds only them.
pub(super) fn run<I, Fut, T>(
    ops: I,
    timeout: Duration,
    quorum: usize,
    vote: fn(&T) -> Vote,
    rule: Rule,
    stragglers: Stragglers,
) -> impl Future<Output = Answers<T>>
where
    I: IntoIterator<Item = Fut>,
    I::IntoIter: ExactSizeIterator,
    Fut: Future<Output = Result<T, NodeFailureReason>> + Send + 'static,
    T: Send + 'static,
{
    let mut ops = ops.into_iter();
    let nodes = ops.len();
    // One node: nothing to tally against, no boxing.
    let single = if nodes == 1 { ops.next() } else { None };
    let pending: Vec<_> = ops.map(|op| Some(Box::pin(op))).collect();
    async move {
        match single {
            Some(op) => run_one(op, timeout, quorum, vote, rule).await,
            None => run_many(pending, timeout, quorum, vote, rule, stragglers).await,
        }
    }
}

async fn run_one<Fut, T>(
    op: Fut,
    timeout: Duration,
    quorum: usize,
    vote: fn(&T) -> Vote,
    rule: Rule,
) -> Answers<T>
where
    Fut: Future<Output = Result<T, NodeFailureReason>>,
{
    let answer = tokio::time::timeout(timeout, op)
        .await
        .unwrap_or(Err(NodeFailureReason::Timeout(timeout)));
    let mut tally = Tally::new(1);
    tally.record(answer.as_ref().ok().map(vote));
    Answers {
        verdict: tally.verdict(quorum, rule).unwrap_or(Verdict::NoQuorum),
        answers: vec![Some(answer)],
    }
}

async fn run_many<Fut, T>(
    pending: Vec<Option<Pin<Box<Fut>>>>,
    timeout: Duration,
    quorum: usize,
    vote: fn(&T) -> Vote,
    rule: Rule,
    stragglers: Stragglers,
) -> Answers<T>
where
    Fut: Future<Output = Result<T, NodeFailureReason>> + Send + 'static,
    T: Send + 'static,
{
    let nodes = pending.len();
    let started = tokio::time::Instant::now();
    let deadline = started + timeout;
    let mut round = Round {
        pending,
        answers: (0..nodes).map(|_| None).collect(),
        vote,
        tally: Tally::new(nodes),
    };
    let early = stragglers != Stragglers::Await;
    let mut timer = std::pin::pin!(tokio::time::sleep_until(deadline));
    let timed_out = std::future::poll_fn(|cx| {
        if round.poll_pending(cx) || (early && round.tally.verdict(quorum, rule).is_some()) {
            Poll::Ready(false)
        } else {
            timer.as_mut().poll(cx).map(|()| true)
        }
    })
    .await;
    if timed_out {
        round.time_out(timeout);
    } else if stragglers == Stragglers::Finish && round.tally.pending > 0 {
        // Healthy nodes answer within moments of each other: give them a short grace (as
        // long as the verdict took, at least 1 ms) before handing the rest to a background
        // task, so that the common case spawns nothing.
        let grace = started.elapsed().max(Duration::from_millis(1));
        timer
            .as_mut()
            .reset(deadline.min(tokio::time::Instant::now() + grace));
        std::future::poll_fn(|cx| {
            if round.poll_pending(cx) {
                Poll::Ready(())
            } else {
                timer.as_mut().poll(cx)
            }
        })
        .await;
        if tokio::time::Instant::now() >= deadline {
            round.time_out(timeout);
        }
        let rest: Vec<_> = round.pending.drain(..).flatten().collect();
        if !rest.is_empty() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(tokio::time::timeout_at(
                    deadline,
                    futures_util::future::join_all(rest),
                ));
            }
        }
    }
    Answers {
        verdict: round
            .tally
            .verdict(quorum, rule)
            .unwrap_or(Verdict::NoQuorum),
        answers: round.answers,
    }
}

/// The node operations of one [`run`], polled in place.
struct Round<Fut, T> {
    pending: Vec<Option<Pin<Box<Fut>>>>,
    answers: Vec<Option<Result<T, NodeFailureReason>>>,
    vote: fn(&T) -> Vote,
    tally: Tally,
}

impl<Fut, T> Round<Fut, T>
where
    Fut: Future<Output = Result<T, NodeFailureReason>>,
{
    /// Polls the operations still pending and records their answers; true once none is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> bool {
        let mut all_done = true;
        for (slot, answer) in self.pending.iter_mut().zip(&mut self.answers) {
            let Some(operation) = slot else { continue };
            match operation.as_mut().poll(cx) {
                Poll::Ready(result) => {
                    *slot = None;
                    self.tally.record(result.as_ref().ok().map(self.vote));
                    *answer = Some(result);
                }
                Poll::Pending => all_done = false,
            }
        }
        all_done
    }

    /// Counts the operations still pending at the deadline as timed out, and drops them.
    fn time_out(&mut self, timeout: Duration) {
        for (slot, answer) in self.pending.iter_mut().zip(&mut self.answers) {
            if slot.take().is_some() {
                self.tally.record(None);
                *answer = Some(Err(NodeFailureReason::Timeout(timeout)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tally of `won`, `against` and `failed` answers, `pending` nodes not heard from.
    fn tally(won: usize, against: usize, failed: usize, pending: usize) -> Tally {
        Tally {
            won,
            against,
            failed,
            pending,
        }
    }

    const RULES: [Rule; 2] = [Rule::Contest, Rule::Proof];

    #[test]
    fn a_quorum_of_votes_wins_whatever_is_pending() {
        for rule in RULES {
            assert_eq!(tally(2, 0, 0, 1).verdict(2, rule), Some(Verdict::Won));
            assert_eq!(tally(3, 1, 1, 0).verdict(3, rule), Some(Verdict::Won));
            assert_eq!(tally(1, 0, 0, 0).verdict(1, rule), Some(Verdict::Won));
        }
    }

    #[test]
    fn taken_needs_a_quorum_of_answers() {
        // 5 nodes, 3 killed: two "held" answers decide nothing.
        assert_eq!(
            tally(0, 2, 3, 0).verdict(3, Rule::Contest),
            Some(Verdict::NoQuorum)
        );
        // Two held and one failed, two to come: a quorum of OKs is out of reach, but
        // whether a quorum answers is not known yet.
        assert_eq!(tally(0, 2, 1, 2).verdict(3, Rule::Contest), None);
        assert_eq!(
            tally(0, 3, 1, 1).verdict(3, Rule::Contest),
            Some(Verdict::Lost)
        );
        // 3 nodes, one hung: two held answers are a quorum of answers.
        assert_eq!(
            tally(0, 2, 0, 1).verdict(2, Rule::Contest),
            Some(Verdict::Lost)
        );
        // One OK, one held, the third could still be an OK.
        assert_eq!(tally(1, 1, 0, 1).verdict(2, Rule::Contest), None);
        // A quorum answered, with the failed node's OK it still would not be a quorum.
        assert_eq!(
            tally(1, 2, 1, 0).verdict(3, Rule::Contest),
            Some(Verdict::Lost)
        );
        assert_eq!(
            tally(1, 1, 1, 0).verdict(2, Rule::Contest),
            Some(Verdict::Lost)
        );
        assert_eq!(
            tally(1, 0, 2, 0).verdict(2, Rule::Contest),
            Some(Verdict::NoQuorum)
        );
    }

    #[test]
    fn expired_needs_n_minus_quorum_plus_one_answers_against() {
        // 5 nodes: token on 2, gone on 2, one unreachable that may hold it.
        assert_eq!(
            tally(2, 2, 1, 0).verdict(3, Rule::Proof),
            Some(Verdict::NoQuorum)
        );
        assert_eq!(tally(2, 2, 0, 1).verdict(3, Rule::Proof), None);
        // Gone on 3 of 5, 2 of 3: proof, whatever the rest say.
        assert_eq!(
            tally(0, 3, 0, 2).verdict(3, Rule::Proof),
            Some(Verdict::Lost)
        );
        assert_eq!(
            tally(1, 3, 1, 0).verdict(3, Rule::Proof),
            Some(Verdict::Lost)
        );
        assert_eq!(
            tally(0, 2, 0, 1).verdict(2, Rule::Proof),
            Some(Verdict::Lost)
        );
        // 3 nodes: gone on 1, one failed, one holds: no proof either way.
        assert_eq!(
            tally(1, 1, 1, 0).verdict(2, Rule::Proof),
            Some(Verdict::NoQuorum)
        );
        // 4 nodes, quorum 3: gone on 2 leaves at most 2.
        assert_eq!(
            tally(1, 2, 0, 1).verdict(3, Rule::Proof),
            Some(Verdict::Lost)
        );
        // 1 node.
        assert_eq!(
            tally(0, 1, 0, 0).verdict(1, Rule::Proof),
            Some(Verdict::Lost)
        );
        assert_eq!(
            tally(0, 0, 1, 0).verdict(1, Rule::Proof),
            Some(Verdict::NoQuorum)
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
            for won in 0..=nodes {
                for against in 0..=nodes - won {
                    let failed = nodes - won - against;
                    for rule in RULES {
                        let verdict = tally(won, against, failed, 0).verdict(quorum, rule);
                        let lost = match rule {
                            Rule::Contest => won + against >= quorum,
                            Rule::Proof => against > nodes - quorum,
                        };
                        let expected = if won >= quorum {
                            Verdict::Won
                        } else if lost {
                            Verdict::Lost
                        } else {
                            Verdict::NoQuorum
                        };
                        assert_eq!(
                            verdict,
                            Some(expected),
                            "{won}/{against}/{failed} of {nodes}, {rule:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_early_verdict_is_the_one_the_pending_nodes_cannot_change() {
        // Whatever the pending nodes answer, the final verdict is the early one.
        for nodes in 1..=5 {
            let quorum = nodes / 2 + 1;
            for known in 0..=nodes {
                for won in 0..=known {
                    for against in 0..=known - won {
                        let failed = known - won - against;
                        let pending = nodes - known;
                        for rule in RULES {
                            let Some(early) =
                                tally(won, against, failed, pending).verdict(quorum, rule)
                            else {
                                continue;
                            };
                            for w in 0..=pending {
                                for a in 0..=pending - w {
                                    let f = pending - w - a;
                                    let last = tally(won + w, against + a, failed + f, 0)
                                        .verdict(quorum, rule);
                                    assert_eq!(last, Some(early), "{rule:?}");
                                }
                            }
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

    async fn answer(value: bool) -> Result<bool, NodeFailureReason> {
        Ok(value)
    }

    fn vote(value: &bool) -> Vote {
        Vote::of(*value)
    }

    #[tokio::test]
    async fn run_returns_at_the_verdict_without_the_hung_node() {
        let timeout = Duration::from_secs(30);
        let ops: Vec<Pin<Box<dyn Future<Output = _> + Send>>> = vec![
            Box::pin(answer(true)),
            Box::pin(std::future::pending()),
            Box::pin(answer(true)),
        ];
        let started = std::time::Instant::now();
        let answers = run(ops, timeout, 2, vote, Rule::Proof, Stragglers::Drop).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(answers.verdict, Verdict::Won);
        assert!(
            answers.answers[1].is_none(),
            "the hung node was not awaited"
        );
        assert_eq!(answers.values().count(), 2);
    }

    #[tokio::test]
    async fn run_times_out_the_nodes_it_needs() {
        let timeout = Duration::from_millis(50);
        let ops: Vec<Pin<Box<dyn Future<Output = _> + Send>>> = vec![
            Box::pin(answer(true)),
            Box::pin(std::future::pending()),
            Box::pin(std::future::pending()),
        ];
        let answers = run(ops, timeout, 2, vote, Rule::Proof, Stragglers::Finish).await;
        assert_eq!(answers.verdict, Verdict::NoQuorum);
        assert!(matches!(
            answers.answers[1],
            Some(Err(NodeFailureReason::Timeout(t))) if t == timeout
        ));
    }

    #[tokio::test]
    async fn await_waits_for_every_node() {
        let ops: Vec<Pin<Box<dyn Future<Output = _> + Send>>> = vec![
            Box::pin(answer(true)),
            Box::pin(answer(true)),
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(false)
            }),
        ];
        let answers = run(
            ops,
            Duration::from_secs(5),
            2,
            vote,
            Rule::Proof,
            Stragglers::Await,
        )
        .await;
        assert_eq!(answers.verdict, Verdict::Won);
        assert!(answers.answers.iter().all(Option::is_some));
    }
}
