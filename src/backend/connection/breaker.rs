//! The outage breaker of one node's connection: after [`OPEN_AFTER`] failures in a row,
//! the node's commands fail at once for [`COOL_DOWN`], without waiting for the node
//! timeout; then the next command is the probe, alone, and its outcome closes the breaker
//! or opens it for another cool-down. Every store (a Redlock's nodes, a limiter's store)
//! has one per node, so a store whose nodes are all down answers at once, and each layer
//! applies its outage rule (fail open or closed) without delay. A new connection to the
//! node (the background reconnection after a restart or a failover) closes it too.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Failures in a row (a failed connection attempt or command, a silent node) that open
/// the breaker: 3.
pub(crate) const OPEN_AFTER: u32 = 3;
/// How long an open breaker fails commands at once before a probe: 500 ms.
pub(crate) const COOL_DOWN: Duration = Duration::from_millis(500);
/// How long a probe may stay unanswered before another command probes: 5 s (a probe
/// whose caller dropped it leaves no outcome).
const PROBE_STALE: Duration = Duration::from_secs(5);

/// How long a command given up by its caller must have waited, with nothing answered, to
/// count as a failure of the node for its outage breaker: 10 ms (a command dropped sooner
/// was cancelled, not timed out).
pub(super) const GIVEN_UP_AFTER: Duration = Duration::from_millis(10);

/// The error of a command refused by an open breaker on `node`, the next probe in `left`.
pub(super) fn refused(node: &str, left: Duration) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Io,
        "outage breaker open",
        format!(
            "{node} failed {OPEN_AFTER} times in a row; commands fail at once for {COOL_DOWN:?} after each failure, then one probes (next in {left:?})"
        ),
    ))
}

/// Milliseconds since the first use, never 0 (0 means "closed" and "no probe").
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let elapsed = START.get_or_init(Instant::now).elapsed().as_millis();
    u64::try_from(elapsed).unwrap_or(u64::MAX).saturating_add(1)
}

fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Whether a command may go to the node.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Closed,
    /// The breaker is open and this command is its probe.
    Probe,
    /// The breaker is open: fail at once, with the time until the next probe.
    Refused(Duration),
}

#[derive(Debug, Default)]
pub(crate) struct Breaker {
    failures: AtomicU32,
    /// When the cool-down ends (see [`now_ms`]); 0 while closed.
    open_until: AtomicU64,
    /// When the running probe started; 0 when none runs.
    probe_since: AtomicU64,
}

impl Breaker {
    pub(crate) fn pass(&self) -> Pass {
        // Closed, as it is while the node answers: no clock read.
        if self.open_until.load(Ordering::Acquire) == 0 {
            return Pass::Closed;
        }
        self.pass_at(now_ms())
    }

    /// [`pass`](Self::pass) at `now` (see [`now_ms`]).
    fn pass_at(&self, now: u64) -> Pass {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Pass::Closed;
        }
        if now < until {
            return Pass::Refused(Duration::from_millis(until - now));
        }
        let since = self.probe_since.load(Ordering::Acquire);
        let stale = since != 0 && now.saturating_sub(since) > ms(PROBE_STALE);
        if (since == 0 || stale)
            && self
                .probe_since
                .compare_exchange(since, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Pass::Probe;
        }
        Pass::Refused(Duration::ZERO)
    }

    /// The node answered: the breaker closes. Returns whether it was open.
    pub(crate) fn succeeded(&self) -> bool {
        self.failures.store(0, Ordering::Release);
        if self.open_until.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.probe_since.store(0, Ordering::Release);
        self.open_until.swap(0, Ordering::AcqRel) != 0
    }

    /// The node failed: the breaker opens after [`OPEN_AFTER`] in a row, and an open one
    /// starts another cool-down. Returns whether it opened now (was closed).
    pub(crate) fn failed(&self) -> bool {
        let failures = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        let open = self.open_until.load(Ordering::Acquire) != 0;
        if !open && failures < OPEN_AFTER {
            return false;
        }
        self.probe_since.store(0, Ordering::Release);
        let until = now_ms().saturating_add(ms(COOL_DOWN));
        self.open_until.swap(until, Ordering::AcqRel) == 0
    }
}

/// Logs and counts a change of a node's outage breaker (`open` or `closed`).
pub(super) fn breaker_changed(node: &str, state: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tower_redlock_breaker_transitions_total",
        "node" => node.to_owned(),
        "state" => state
    )
    .increment(1);
    if state == "open" {
        tracing::warn!(
            node,
            "outage breaker open: the node failed {} times in a row; its commands fail at once, and one probes every {:?}",
            OPEN_AFTER,
            COOL_DOWN
        );
    } else {
        tracing::info!(node, "outage breaker closed: the node answers again");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_in_a_row_probes_alone_and_closes_on_an_answer() {
        let breaker = Breaker::default();
        assert!(!breaker.failed() && !breaker.failed());
        assert_eq!(breaker.pass(), Pass::Closed);
        assert!(!breaker.succeeded(), "an answer resets the count");
        assert!(!breaker.failed() && !breaker.failed());
        assert!(breaker.failed(), "the third failure in a row opens it");
        assert!(matches!(breaker.pass(), Pass::Refused(left) if left <= COOL_DOWN));
        // After the cool-down: one probe, the others still refused.
        breaker.open_until.store(1, Ordering::Release);
        assert_eq!(breaker.pass(), Pass::Probe);
        assert_eq!(breaker.pass(), Pass::Refused(Duration::ZERO));
        // The probe fails: another cool-down, and no probe meanwhile.
        assert!(!breaker.failed(), "already open");
        assert!(matches!(breaker.pass(), Pass::Refused(left) if !left.is_zero()));
        breaker.open_until.store(1, Ordering::Release);
        assert_eq!(breaker.pass(), Pass::Probe);
        assert!(breaker.succeeded());
        assert_eq!(breaker.pass(), Pass::Closed);
    }

    #[test]
    fn the_cool_down_runs_on_the_clock() {
        let breaker = Breaker::default();
        for _ in 0..OPEN_AFTER {
            breaker.failed();
        }
        let Pass::Refused(left) = breaker.pass() else {
            panic!("open after {OPEN_AFTER} failures")
        };
        assert!(left > COOL_DOWN / 2 && left <= COOL_DOWN, "{left:?}");
        // Waiting out the cool-down is the subject here: then one probe goes.
        std::thread::sleep(COOL_DOWN);
        assert_eq!(breaker.pass(), Pass::Probe);
    }

    #[test]
    fn a_probe_without_an_outcome_gives_way_to_another_once_stale() {
        let breaker = Breaker::default();
        for _ in 0..OPEN_AFTER {
            breaker.failed();
        }
        let until = breaker.open_until.load(Ordering::Acquire);
        assert!(
            matches!(breaker.pass_at(until - 1), Pass::Refused(left) if left == Duration::from_millis(1))
        );
        assert_eq!(breaker.pass_at(until), Pass::Probe);
        let stale = until + ms(PROBE_STALE);
        assert_eq!(
            breaker.pass_at(stale),
            Pass::Refused(Duration::ZERO),
            "not yet stale"
        );
        assert_eq!(
            breaker.pass_at(stale + 1),
            Pass::Probe,
            "stale: another probes"
        );
        assert_eq!(
            breaker.pass_at(stale + 2),
            Pass::Refused(Duration::ZERO),
            "one at a time"
        );
    }

    /// A writer of log lines into a shared buffer.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut lines = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            lines.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_change_logs_one_line_at_its_level() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            breaker_changed("10.0.0.7:6379", "open");
            breaker_changed("10.0.0.7:6379", "closed");
        });
        let text = String::from_utf8_lossy(
            &lines
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
        .into_owned();
        let logged: Vec<&str> = text.lines().collect();
        assert_eq!(logged.len(), 2, "{text}");
        assert!(
            logged
                .first()
                .is_some_and(|l| l.contains("WARN") && l.contains("outage breaker open")),
            "{text}"
        );
        assert!(
            logged
                .get(1)
                .is_some_and(|l| l.contains("INFO") && l.contains("outage breaker closed")),
            "{text}"
        );
    }

    #[cfg(feature = "metrics")]
    #[test]
    fn a_change_is_counted_per_node_and_state() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            breaker_changed("n1", "open");
            breaker_changed("n1", "open");
            breaker_changed("n1", "closed");
        });
        let rendered = handle.render();
        for line in [
            r#"tower_redlock_breaker_transitions_total{node="n1",state="open"} 2"#,
            r#"tower_redlock_breaker_transitions_total{node="n1",state="closed"} 1"#,
        ] {
            assert!(rendered.contains(line), "{line} not in {rendered}");
        }
    }
}
