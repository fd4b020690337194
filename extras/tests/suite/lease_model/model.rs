//! The model: every lease the test was granted, what each node was seen to hold of it, and
//! the properties checked against it after every step.
//!
//! A lease is *protected* while it still holds a quorum of nodes: on one process (the
//! in-process store) always; on Redis while at least `N/2 + 1` of the nodes seen holding its
//! token after the acquisition still may (a node killed or restarted forgets it, and a node
//! paused may miss a renewal). Past that, losing it is the documented hazard of a node that
//! restarts empty (see the crate guide), not a fault, and the model stops asserting on it.

use std::time::{Duration, Instant};

use tower_redlock::{Lease, LeaseStatus, LockError};

use super::Node;

/// One lease the test was granted, explicitly, by a guard (`with_lock`) or by a layer.
pub struct Held {
    pub key: usize,
    /// The client that holds it.
    pub client: usize,
    pub lease: Lease,
    /// A guard's live status: its validity moves with the watchdog's renewals.
    pub status: Option<LeaseStatus>,
    /// Per node: seen holding the token after the acquisition, and neither killed nor
    /// restarted nor paused since (Redis).
    pub holders: Vec<bool>,
    /// When the last command that could set or extend it on a node was answered: it is
    /// gone from every node a TTL later.
    pub last_touch: Instant,
    /// Released, with the release checked on the nodes.
    pub released: bool,
    /// Still the test's to extend or release (an explicit lease not yet given up).
    pub active: bool,
    /// A watchdog may still renew it (a guard not yet ended).
    pub renewing: bool,
}

impl Held {
    /// The end of its validity as the holder knows it now.
    pub fn valid_until(&self) -> Instant {
        self.status
            .as_ref()
            .map_or(self.lease.valid_until(), LeaseStatus::valid_until)
    }
}

/// The highest fencing token of a key, and the nodes seen storing a counter at least that
/// high (not killed or restarted since).
pub struct Fence {
    pub high: u64,
    pub nodes: Vec<bool>,
}

/// How much later than the model's bound Redis may still find a key alive: it expires keys
/// on its own clock, in whole milliseconds, from when it ran the command.
const REDIS_SLACK: Duration = Duration::from_millis(10);

pub struct Model {
    /// 0 for the in-process store.
    pub nodes: usize,
    pub ttl: Duration,
    pub held: Vec<Held>,
    pub fences: Vec<Option<Fence>>,
    /// Per key: until when a refused or failed attempt may have left a key behind on a
    /// node (cleaned up in the background, or by its TTL).
    pub dirty_until: Vec<Instant>,
    pub node_state: Vec<Node>,
    /// Until when a node event may still make the clients' commands fail.
    pub unsettled_until: Instant,
}

impl Model {
    pub fn new(nodes: usize, keys: usize, ttl: Duration) -> Self {
        let now = Instant::now();
        Self {
            nodes,
            ttl,
            held: Vec::new(),
            fences: (0..keys).map(|_| None).collect(),
            dirty_until: vec![now; keys],
            node_state: vec![Node::Up; nodes],
            unsettled_until: now,
        }
    }

    pub fn quorum(&self) -> usize {
        self.nodes / 2 + 1
    }

    pub fn protected(&self, held: &Held) -> bool {
        self.nodes == 0 || held.holders.iter().filter(|h| **h).count() >= self.quorum()
    }

    /// Whether the fencing counters still guarantee a higher token to the next
    /// acquisition: every quorum meets a node that stores the highest.
    fn fence_chain_holds(&self, fence: &Fence) -> bool {
        self.nodes == 0 || fence.nodes.iter().filter(|n| **n).count() > self.nodes - self.quorum()
    }

    /// A lease on `key` was granted, answered at `answered`: no other lease on the key may
    /// still be valid and protected then, and its fencing token must be above every
    /// earlier one while the counters are intact.
    pub fn check_granted(&self, key: usize, lease: &Lease, answered: Instant) {
        for other in self.held.iter().filter(|h| h.key == key && !h.released) {
            if other.lease.token() == lease.token() || !self.protected(other) {
                continue;
            }
            let other_until = other.valid_until();
            stats::add(&stats::EXCLUSION_CHECKS);
            assert!(
                other_until <= answered,
                "two holders of key {key}: {:?} granted while {:?} is valid for {:?} more",
                lease.token(),
                other.lease.token(),
                other_until - answered,
            );
        }
        if let (Some(token), Some(fence)) = (lease.fencing_token(), &self.fences[key]) {
            if self.fence_chain_holds(fence) {
                stats::add(&stats::FENCE_CHECKS);
                assert!(
                    token > fence.high,
                    "fencing token {token} on key {key} after {} was issued",
                    fence.high
                );
            }
        }
    }

    /// Records a fenced lease's token; `seen` says per node whether its counter was read
    /// at least that high.
    pub fn fenced(&mut self, key: usize, token: u64, seen: Vec<bool>) {
        let keep = match &self.fences[key] {
            Some(fence) if self.fence_chain_holds(fence) => fence.high.max(token),
            _ => token,
        };
        self.fences[key] = Some(Fence {
            high: keep,
            nodes: seen,
        });
    }

    /// Whether an attempt on `key` starting at `start` must find it free: no lease on it
    /// may still be there, and (on Redis) every node is up and settled and nothing a
    /// refused attempt set can linger.
    pub fn must_be_free(&self, key: usize, start: Instant) -> bool {
        let free = self.free_but(key, start, None);
        if free {
            stats::add(&stats::FREE_CHECKS);
        }
        free
    }

    /// [`must_be_free`](Self::must_be_free), but for the lease `except` (index in
    /// [`held`](Self::held)).
    pub fn free_but(&self, key: usize, start: Instant, except: Option<usize>) -> bool {
        let others = self.held.iter().enumerate();
        let others = others.filter(|(i, h)| h.key == key && Some(*i) != except);
        let leases_gone = others.map(|(_, h)| h).all(|h| {
            if h.released {
                return true;
            }
            if self.nodes == 0 {
                // In process the store expires a lease exactly at its validity.
                return h.valid_until() <= start;
            }
            // Redis expires a key on its own clock, in whole milliseconds.
            !h.renewing && h.last_touch + self.ttl + REDIS_SLACK < start
        });
        leases_gone
            && (self.nodes == 0
                || (self.dirty_until[key] < start
                    && self.unsettled_until < start
                    && self.node_state.iter().all(|n| *n == Node::Up)))
    }

    /// An extension or release of `held` answered `Expired` at `answered`: only allowed
    /// once its validity ended (or it lost its quorum).
    pub fn check_expired(&self, held: &Held, error: &LockError, answered: Instant) {
        if let LockError::Expired { .. } = error {
            let until = held.valid_until();
            stats::add(&stats::EXPIRED_CHECKS);
            assert!(
                !self.protected(held) || until <= answered,
                "{error} for {:?}, valid for {:?} more",
                held.lease.token(),
                until - answered
            );
        }
    }

    /// A node was killed or restarted: it forgets every lease and counter.
    pub fn forget(&mut self, node: usize) {
        for held in &mut self.held {
            held.holders[node] = false;
        }
        for fence in self.fences.iter_mut().flatten() {
            fence.nodes[node] = false;
        }
        self.node_event();
    }

    /// A node was paused: a renewal meanwhile does not reach it, so its copies may expire
    /// before the holders' validity ends.
    pub fn paused(&mut self, node: usize) {
        for held in &mut self.held {
            held.holders[node] = false;
        }
        self.node_event();
    }

    pub fn node_event(&mut self) {
        stats::add(&stats::NODE_EVENTS);
        self.unsettled_until = Instant::now() + Duration::from_secs(1);
    }

    /// An attempt on `key` was refused or failed at `answered`: what it set on some nodes
    /// may stay until its cleanup or its TTL.
    pub fn dirty(&mut self, key: usize, answered: Instant) {
        self.dirty_until[key] = answered + self.ttl + Duration::from_millis(10);
    }
}

/// What the checks saw, summed over the cases of a test (its thread): printed after each case with
/// `LEASE_MODEL_STATS=1`, so that a campaign shows what it exercised.
pub mod stats {
    use std::sync::atomic::{AtomicU64, Ordering};

    macro_rules! counters {
        ($($name:ident),*) => {
            thread_local! {
                $(pub static $name: AtomicU64 = const { AtomicU64::new(0) };)*
            }

            pub fn line() -> String {
                [$(format!("{}={}", stringify!($name).to_lowercase(), $name.with(|c| c.load(Ordering::Relaxed)))),*].join(" ")
            }
        };
    }

    counters!(
        STEPS,
        GRANTED,
        REFUSED,
        EXCLUSION_CHECKS,
        FENCE_CHECKS,
        EXPIRED_CHECKS,
        RELEASE_CHECKS,
        WAKE_CHECKS,
        RENEWAL_CHECKS,
        FREE_CHECKS,
        NODE_EVENTS
    );

    pub fn add(counter: &'static std::thread::LocalKey<AtomicU64>) {
        counter.with(|c| c.fetch_add(1, Ordering::Relaxed));
    }
}
