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

    /// The verdict, once the answers so far decide it (whatever the pending nodes say);
    /// `None` while they could still change it. Always `Some` once nothing is pending.
    pub(super) fn verdict(&self, quorum: usize) -> Option<Verdict> {
        let nodes = self.nodes();
        if self.won >= quorum {
            return Some(Verdict::Won);
        }
        let tolerated = nodes.saturating_sub(quorum);
        if self.against + self.failed > tolerated {
            return Some(if self.failed > tolerated {
                Verdict::NoQuorum
            } else {
                Verdict::Lost
            });
        }
        None
    }
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
            Some(op) => run_one(op, timeout, quorum, vote).await,
            None => run_many(pending, timeout, quorum, vote, stragglers).await,
        }
    }
}

async fn run_one<Fut, T>(
    op: Fut,
    timeout: Duration,
    quorum: usize,
    vote: fn(&T) -> Vote,
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
        verdict: tally.verdict(quorum).unwrap_or(Verdict::NoQuorum),
        answers: vec![Some(answer)],
    }
}

async fn run_many<Fut, T>(
    pending: Vec<Option<Pin<Box<Fut>>>>,
    timeout: Duration,
    quorum: usize,
    vote: fn(&T) -> Vote,
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
        if round.poll_pending(cx) || (early && round.tally.verdict(quorum).is_some()) {
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
        verdict: round.tally.verdict(quorum).unwrap_or(Verdict::NoQuorum),
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

    #[test]
    fn a_quorum_of_votes_wins_whatever_is_pending() {
        assert_eq!(tally(2, 0, 0, 1).verdict(2), Some(Verdict::Won));
        assert_eq!(tally(3, 1, 1, 0).verdict(3), Some(Verdict::Won));
        assert_eq!(tally(1, 0, 0, 0).verdict(1), Some(Verdict::Won));
    }

    #[test]
    fn undecided_while_pending_nodes_could_still_change_it() {
        assert_eq!(tally(1, 0, 0, 2).verdict(2), None);
        assert_eq!(tally(1, 1, 0, 1).verdict(2), None);
        assert_eq!(tally(2, 1, 0, 2).verdict(3), None);
    }

    #[test]
    fn every_tally_with_nothing_pending_has_a_verdict() {
        for nodes in 1..=7 {
            let quorum = nodes / 2 + 1;
            for won in 0..=nodes {
                for against in 0..=nodes - won {
                    let failed = nodes - won - against;
                    assert!(
                        tally(won, against, failed, 0).verdict(quorum).is_some(),
                        "{won}/{against}/{failed} of {nodes}"
                    );
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
        if *value { Vote::For } else { Vote::Against }
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
        let answers = run(ops, timeout, 2, vote, Stragglers::Drop).await;
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
        let answers = run(ops, timeout, 2, vote, Stragglers::Finish).await;
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
        let answers = run(ops, Duration::from_secs(5), 2, vote, Stragglers::Await).await;
        assert_eq!(answers.verdict, Verdict::Won);
        assert!(answers.answers.iter().all(Option::is_some));
    }
}
