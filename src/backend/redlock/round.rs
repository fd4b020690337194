//! The quorum round: one operation sent to every node at once under one deadline, the
//! answers tallied as they come ([`Tally`]), and a return as soon as they decide the
//! verdict, finishing or dropping the stragglers as the caller asks.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::Either;
use smallvec::SmallVec;

use super::tally::{QuorumVerdict, Rule, Tally, Vote};
use crate::error::NodeFailureReason;
use crate::future::boxed;

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

/// Every node's answer in node order (`None` for a node whose answer was not awaited),
/// and the verdict they gave.
pub(super) struct Answers<T> {
    pub(super) verdict: QuorumVerdict,
    pub(super) answers: NodeAnswers<T>,
}

/// One answer per node, kept inline for a single node: a round on one node allocates
/// nothing for its answers.
pub(super) type NodeAnswers<T> = SmallVec<[Option<Result<T, NodeFailureReason>>; 1]>;

impl<T> Answers<T> {
    /// The answers that came, in node order, without the failures.
    pub(super) fn values(&self) -> impl Iterator<Item = &T> {
        self.answers
            .iter()
            .filter_map(|a| a.as_ref()?.as_ref().ok())
    }
}

/// `op` on the node `label`, counted in the node-error metric when it answers with an
/// error, or is dropped unfinished at or after `deadline` (not before: the other nodes
/// decided, and nothing says it failed).
pub(super) fn counted<Fut, T>(
    op: Fut,
    label: Arc<str>,
    deadline: std::time::Instant,
) -> Counted<Fut>
where
    Fut: Future<Output = Result<T, NodeFailureReason>> + Send + 'static,
{
    let watch = NodeWatch {
        label,
        deadline,
        done: false,
    };
    Counted { op, watch }
}

pin_project_lite::pin_project! {
    /// A node's operation and its [`NodeWatch`]: a future of its own rather than an
    /// `async` block, which would hold `op` twice, or `futures_util`'s `map`, which
    /// copies itself whole (the operation's future included) as it completes.
    pub(super) struct Counted<Fut> {
        #[pin]
        op: Fut,
        watch: NodeWatch,
    }
}

impl<Fut, T> Future for Counted<Fut>
where
    Fut: Future<Output = Result<T, NodeFailureReason>>,
{
    type Output = Result<T, NodeFailureReason>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = std::task::ready!(this.op.poll(cx));
        this.watch.done = true;
        if answer.is_err() {
            crate::observe::node_error(&this.watch.label);
        }
        Poll::Ready(answer)
    }
}

struct NodeWatch {
    label: Arc<str>,
    deadline: std::time::Instant,
    done: bool,
}

impl Drop for NodeWatch {
    fn drop(&mut self) {
        if !self.done && std::time::Instant::now() >= self.deadline {
            crate::observe::node_error(&self.label);
        }
    }
}

/// The node operations of one round, made before it starts (keeping the iterator and its
/// borrows out of the round's future): one, made where the round keeps it, or several,
/// each boxed in place (an operation's future is large, and a box of a built one would
/// copy it whole).
pub(super) enum Ops<M, Fut> {
    One(M),
    Many(Vec<Option<Pin<Box<Fut>>>>),
}

impl<M, Fut> Ops<M, Fut>
where
    M: FnOnce() -> Fut,
    Fut: Future,
{
    // Inlined, like `run`, so that a single operation is built where the round keeps it.
    #[inline(always)]
    pub(super) fn new<I>(makers: I) -> Self
    where
        I: IntoIterator<Item = M>,
        I::IntoIter: ExactSizeIterator,
    {
        let mut makers = makers.into_iter();
        if makers.len() == 1 {
            if let Some(make) = makers.next() {
                return Ops::One(make);
            }
        }
        Ops::Many(makers.map(|make| Some(boxed(make))).collect())
    }
}

/// Runs `ops` (one per node, all at once, under one timer ending `timeout` after
/// `started`) and tallies their answers with `vote`; unless `stragglers` is
/// [`Stragglers::Await`], returns as soon as the tally has a verdict. A single node's timer
/// is made here, which needs the Tokio runtime.
#[inline(always)]
pub(super) fn run<M, Fut, T>(
    ops: Ops<M, Fut>,
    started: std::time::Instant,
    timeout: Duration,
    quorum: usize,
    vote: fn(&T) -> Vote,
    rule: Rule,
    stragglers: Stragglers,
) -> impl Future<Output = Answers<T>>
where
    M: FnOnce() -> Fut,
    Fut: Future<Output = Result<T, NodeFailureReason>> + Send + 'static,
    T: Send + 'static,
{
    let started = tokio::time::Instant::from_std(started);
    match ops {
        Ops::One(make) => Either::Left(RunOne {
            op: tokio::time::timeout_at(started + timeout, make()),
            timeout,
            quorum,
            vote,
            rule,
        }),
        Ops::Many(pending) => Either::Right(run_many(
            pending, started, timeout, quorum, vote, rule, stragglers,
        )),
    }
}

pin_project_lite::pin_project! {
/// [`run_one`]'s future: one of its own, as [`Counted`] is.
    pub(super) struct RunOne<Fut, T> {
        #[pin]
        op: tokio::time::Timeout<Fut>,
        timeout: Duration,
        quorum: usize,
        vote: fn(&T) -> Vote,
        rule: Rule,
    }
}

impl<Fut, T> Future for RunOne<Fut, T>
where
    Fut: Future<Output = Result<T, NodeFailureReason>>,
{
    type Output = Answers<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answers<T>> {
        let this = self.project();
        let answer = std::task::ready!(this.op.poll(cx));
        let answer = answer.unwrap_or(Err(NodeFailureReason::Timeout(*this.timeout)));
        let mut tally = Tally::new(1);
        tally.record(answer.as_ref().ok().map(*this.vote));
        Poll::Ready(Answers {
            verdict: tally
                .verdict(*this.quorum, *this.rule)
                .unwrap_or(QuorumVerdict::NoQuorum),
            answers: SmallVec::from_buf([Some(answer)]),
        })
    }
}

/// [`run`] on more than one node.
async fn run_many<Fut, T>(
    pending: Vec<Option<Pin<Box<Fut>>>>,
    started: tokio::time::Instant,
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
        // A short grace (as long as the verdict took, at least 1 ms) before handing the
        // rest to a background task: healthy nodes usually answer within it.
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
            .unwrap_or(QuorumVerdict::NoQuorum),
        answers: round.answers,
    }
}

/// The node operations of one [`run`], polled in place.
struct Round<Fut, T> {
    pending: Vec<Option<Pin<Box<Fut>>>>,
    answers: NodeAnswers<T>,
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

    async fn answer(value: bool) -> Result<bool, NodeFailureReason> {
        Ok(value)
    }

    fn vote(value: &bool) -> Vote {
        Vote::of(*value)
    }

    type NodeCall = Pin<Box<dyn Future<Output = Result<bool, NodeFailureReason>> + Send>>;

    fn ok(value: bool) -> NodeCall {
        Box::pin(answer(value))
    }

    fn hung() -> NodeCall {
        Box::pin(std::future::pending())
    }

    /// A round over `ops` from now, a quorum of 2, each voting its answer.
    async fn run_now(
        ops: Vec<NodeCall>,
        timeout: Duration,
        stragglers: Stragglers,
    ) -> Answers<bool> {
        let started = std::time::Instant::now();
        let round = run(
            Ops::new(ops.into_iter().map(|op| move || op)),
            started,
            timeout,
            2,
            vote,
            Rule::Held,
            stragglers,
        );
        round.await
    }

    #[tokio::test]
    async fn run_returns_at_the_verdict_without_the_hung_node() {
        let timeout = Duration::from_secs(30);
        let ops = vec![ok(true), hung(), ok(true)];
        let started = std::time::Instant::now();
        let answers = run_now(ops, timeout, Stragglers::Drop).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(answers.verdict, QuorumVerdict::Won);
        assert!(
            answers.answers[1].is_none(),
            "the hung node was not awaited"
        );
        assert_eq!(answers.values().count(), 2);
    }

    #[tokio::test]
    async fn run_times_out_the_nodes_it_needs() {
        let timeout = Duration::from_millis(50);
        let ops = vec![ok(true), hung(), hung()];
        let answers = run_now(ops, timeout, Stragglers::Finish).await;
        assert_eq!(answers.verdict, QuorumVerdict::NoQuorum);
        assert!(matches!(
            answers.answers[1],
            Some(Err(NodeFailureReason::Timeout(t))) if t == timeout
        ));
    }

    #[tokio::test]
    async fn await_waits_for_every_node() {
        let ops: Vec<NodeCall> = vec![
            ok(true),
            ok(true),
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(false)
            }),
        ];
        let answers = run_now(ops, Duration::from_secs(5), Stragglers::Await).await;
        assert_eq!(answers.verdict, QuorumVerdict::Won);
        assert!(answers.answers.iter().all(Option::is_some));
    }
}
