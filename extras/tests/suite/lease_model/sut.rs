//! The system under test: the clients (two `Redlock`s over the same nodes, or two handles
//! on one `MemoryLocks`), the nodes, the guards running on the test's runtime, and the
//! model they are checked against.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tower_redlock::{LockError, Locks, MemoryLocks, Redlock};

use super::model::{Held, Model, stats};
use super::probe::{self, Renewals};
use super::{KEYS, Node};
use crate::support::{RedisNode, eventually};

/// The prefix of every key (the crate's default).
pub const PREFIX: &str = "tower-redlock:";

/// The resource of key `key`: its scope, `k<key>`, names it in the renewal counts.
pub fn resource(key: usize) -> String {
    format!("k{key}:x")
}

pub fn scope(key: usize) -> String {
    format!("k{key}")
}

/// A `with_lock` running on the test's runtime until told to stop.
pub struct Guard {
    /// Its lease in [`Model::held`].
    pub held: usize,
    pub stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<Result<(), LockError>>,
}

pub struct Sut {
    pub guards: Vec<Guard>,
    pub clients: Vec<Locks>,
    pub model: Model,
    /// Per key: the renewals counted when its last renewing holder ended (a guard, a
    /// layer's request), while no other renews it. No renewal may follow.
    pub closed: Vec<Option<u64>>,
    pub renewals: Arc<Renewals>,
    _trace: tracing::subscriber::DefaultGuard,
    pub rt: tokio::runtime::Runtime,
    pub nodes: Vec<RedisNode>,
}

impl Sut {
    /// The TTL: short, so that leases lapse within a step or two.
    pub fn ttl(nodes: usize) -> Duration {
        if nodes == 0 {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(300)
        }
    }

    /// How long a Redis node is waited for.
    pub const NODE_TIMEOUT: Duration = Duration::from_millis(60);

    pub fn start(nodes: usize) -> Self {
        let renewals = Arc::new(Renewals::default());
        let trace = renewals.install();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ttl = Self::ttl(nodes);
        let redis: Vec<RedisNode> = (0..nodes).map(|_| RedisNode::start()).collect();
        let clients = if nodes == 0 {
            let store = MemoryLocks::builder()
                .ttl(ttl)
                .fencing_tokens(true)
                .build()
                .unwrap();
            vec![Locks::from(store.clone()), Locks::from(store)]
        } else {
            let urls = crate::support::urls(&redis);
            rt.block_on(async {
                let mut clients = Vec::new();
                for client in 0..super::CLIENTS {
                    let redlock = Redlock::builder(urls.clone())
                        .ttl(ttl)
                        .node_timeout(Self::NODE_TIMEOUT)
                        // One client fenced, the other not: both on the same keys.
                        .fencing_tokens(client == 0)
                        .build()
                        .await
                        .unwrap();
                    clients.push(Locks::from(redlock));
                }
                clients
            })
        };
        Self {
            guards: Vec::new(),
            clients,
            model: Model::new(nodes, KEYS, ttl),
            closed: vec![None; KEYS],
            renewals,
            _trace: trace,
            rt,
            nodes: redis,
        }
    }

    pub fn ttl_now(&self) -> Duration {
        self.model.ttl
    }

    /// Which nodes answer commands now.
    fn up(&self) -> Vec<bool> {
        self.model
            .node_state
            .iter()
            .map(|n| *n == Node::Up)
            .collect()
    }

    /// A lease on `key` was granted, answered at `answered`: checked against the model,
    /// then recorded with what the nodes hold of it.
    pub fn granted(
        &mut self,
        key: usize,
        client: usize,
        lease: tower_redlock::Lease,
        answered: Instant,
        status: Option<tower_redlock::LeaseStatus>,
    ) -> usize {
        stats::add(&stats::GRANTED);
        self.model.check_granted(key, &lease, answered);
        let (holders, counters) = self
            .rt
            .block_on(self.read_nodes(lease.key(), lease.token()));
        if let Some(token) = lease.fencing_token() {
            let seen = counters.iter().map(|c| c.is_some_and(|c| c >= token));
            self.model.fenced(key, token, seen.collect());
        }
        let renewing = status.is_some();
        self.model.held.push(Held {
            key,
            client,
            lease,
            status,
            holders,
            last_touch: answered,
            released: false,
            active: !renewing,
            renewing,
        });
        self.model.held.len() - 1
    }

    /// Per node that answers: whether it stores `token` at `lock_key`, and its fencing
    /// counter (`None` for a node down, paused or silent).
    async fn read_nodes(
        &self,
        lock_key: &str,
        token: &tower_redlock::Token,
    ) -> (Vec<bool>, Vec<Option<u64>>) {
        let (mut holders, mut counters) = (Vec::new(), Vec::new());
        for (node, up) in self.nodes.iter().zip(self.up()) {
            if !up {
                holders.push(false);
                counters.push(None);
                continue;
            }
            let url = node.url();
            let value = probe::get(&url, lock_key).await.flatten();
            holders.push(value.as_deref() == Some(token.as_str()));
            counters.push(probe::counter(&url, PREFIX, lock_key).await);
        }
        (holders, counters)
    }

    /// After a release that succeeded: the token is gone from every node that answers (a
    /// straggler's delete is finished in the background, within the node timeout), and in
    /// process the key is free.
    pub fn check_released(&self, key: usize, lease: &tower_redlock::Lease) {
        stats::add(&stats::RELEASE_CHECKS);
        // Before the lease would have lapsed by itself, so that its TTL cannot pass for a
        // delete.
        let deadline = (Instant::now() + Self::NODE_TIMEOUT + Duration::from_millis(40))
            .min(lease.valid_until());
        let within = deadline.saturating_duration_since(Instant::now());
        let token = lease.token().as_str().to_owned();
        let lock_key = lease.key().to_owned();
        if self.nodes.is_empty() {
            let seen = self
                .rt
                .block_on(self.clients[0].inspect(&resource(key)))
                .unwrap();
            assert!(
                !seen.is_held(),
                "key {key} still held after its release: {seen:?}"
            );
            return;
        }
        for (index, (node, up)) in self.nodes.iter().zip(self.up()).enumerate() {
            if !up {
                continue;
            }
            let url = node.url();
            if within.is_zero() {
                continue;
            }
            let gone = self.rt.block_on(eventually(within, || {
                let (url, lock_key, token) = (url.clone(), lock_key.clone(), token.clone());
                async move {
                    // A node that does not answer cannot be checked: only a token read back
                    // fails the check.
                    probe::get(&url, &lock_key).await.flatten().as_deref() != Some(&token)
                }
            }));
            assert!(
                gone,
                "node {index} still stores the token of key {key} after its release"
            );
        }
    }

    /// Checks after every step: no guard was found lost while its lease was valid and
    /// protected, and no renewal followed the end of a key's last renewing holder.
    pub fn check(&self) {
        for guard in &self.guards {
            let held = &self.model.held[guard.held];
            let Some(status) = &held.status else { continue };
            let lost_while_valid = status.is_lost() && Instant::now() < status.valid_until();
            assert!(
                !(lost_while_valid && self.model.protected(held)),
                "a renewal found {:?} gone while it was valid for {:?} more",
                held.lease.token(),
                status.remaining()
            );
        }
        self.check_no_renewal();
    }

    /// No watchdog renewed a key after its last renewing holder ended.
    pub fn check_no_renewal(&self) {
        for (key, closed) in self.closed.iter().enumerate() {
            if let Some(count) = closed {
                stats::add(&stats::RENEWAL_CHECKS);
                let now = self.renewals.of(&scope(key));
                assert_eq!(
                    now,
                    *count,
                    "{} renewal(s) of key {key} after its holder released it",
                    now - count
                );
            }
        }
    }

    /// A holder that renews `key` starts: what came before is checked one last time.
    pub fn renewing(&mut self, key: usize) {
        self.check_no_renewal();
        self.closed[key] = None;
    }

    /// The last renewing holder of `key` ended: from now on no renewal may come.
    pub fn closed(&mut self, key: usize) {
        let still = self
            .guards
            .iter()
            .any(|g| self.model.held[g.held].key == key);
        self.closed[key] = (!still).then(|| self.renewals.of(&scope(key)));
    }

    /// At the end of a case: one more renewal period for a late renewal to show, then the
    /// guards are stopped and everything is dropped on the runtime.
    pub fn finish(mut self) {
        if self.closed.iter().any(Option::is_some) {
            let period = self.ttl_now() / 4 + Duration::from_millis(30);
            self.rt.block_on(async { tokio::time::sleep(period).await });
            self.check_no_renewal();
        }
        for node in &mut self.nodes {
            node.resume_if_paused();
        }
        if std::env::var_os("LEASE_MODEL_STATS").is_some() {
            eprintln!(
                "lease model ({} nodes): {}",
                self.nodes.len(),
                stats::line()
            );
        }
        let guards = std::mem::take(&mut self.guards);
        let clients = std::mem::take(&mut self.clients);
        self.rt.block_on(async move {
            for mut guard in guards {
                drop(guard.stop.take());
                let _ = tokio::time::timeout(Duration::from_secs(2), guard.task).await;
            }
            drop(clients);
        });
    }
}
