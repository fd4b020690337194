//! Each step on the system under test, and what its answer must be given the model.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use proptest::sample::Index;
use tokio::sync::oneshot;
use tower::{Layer, ServiceExt, service_fn};
use tower_redlock::lock::RequestBody;
use tower_redlock::{Lease, LeaseStatus, LockError, LockLayer, LockRequest, Renewal};

use super::model::stats;
use super::probe::Explicit;
use super::sut::{Guard, Sut, resource, scope};
use super::{Node, Step};

/// How an acquisition asks.
#[derive(Clone, Copy)]
enum Ask {
    Acquire,
    TryLock,
    Wait(Duration),
}

impl Sut {
    pub fn run(&mut self, step: &Step) {
        let ttl = self.ttl_now();
        stats::add(&stats::STEPS);
        match *step {
            Step::Acquire { client, key } => self.attempt(client, key, Ask::Acquire),
            Step::TryLock { client, key } => self.attempt(client, key, Ask::TryLock),
            Step::Wait {
                client,
                key,
                within,
            } => {
                self.attempt(client, key, Ask::Wait(within.of(ttl)));
            }
            Step::WaitForRelease { client, lease } => self.wait_for_release(client, lease),
            Step::Extend { lease } => self.extend(lease),
            Step::Unlock { lease } => self.unlock(lease),
            Step::Sleep { span } => self
                .rt
                .block_on(async { tokio::time::sleep(span.of(ttl)).await }),
            Step::Guard { client, key } => self.guard(client, key),
            Step::EndGuard { guard } => self.end_guard(guard),
            Step::Request { client, key } => self.request(client, key),
            Step::Kill { node } => {
                self.nodes[node].kill();
                self.model.node_state[node] = Node::Down;
                self.model.forget(node);
            }
            Step::Restart { node } => {
                self.nodes[node].restart();
                self.model.node_state[node] = Node::Up;
                self.model.forget(node);
            }
            Step::Pause { node } => {
                self.nodes[node].pause();
                self.model.node_state[node] = Node::Paused;
                self.model.paused(node);
            }
            Step::Resume { node } => {
                self.nodes[node].resume();
                self.model.node_state[node] = Node::Up;
                self.model.node_event();
            }
        }
    }

    fn attempt(&mut self, client: usize, key: usize, ask: Ask) {
        let locks = self.clients[client].clone();
        let res = resource(key);
        let start = Instant::now();
        let result = self.rt.block_on(async {
            match ask {
                Ask::Acquire => locks.acquire(LockRequest::new(&res)).await,
                Ask::TryLock => locks.try_lock(&res).await,
                Ask::Wait(within) => locks.acquire(LockRequest::new(&res).wait(within)).await,
            }
        });
        let answered = Instant::now();
        // A wait's last attempt is at its deadline or later.
        let free_by = match ask {
            Ask::Wait(within) => (start + within).checked_sub(Duration::from_millis(2)),
            _ => Some(start),
        };
        if result.is_ok() {
            // Counted as the refusals are: an attempt that had to succeed.
            let _ = free_by.map(|by| self.model.must_be_free(key, by));
        }
        self.answered(client, key, result, free_by, answered);
    }

    /// What an acquisition answered: a lease is checked and recorded; a refusal is wrong
    /// when the model says the key was free by `free_by`.
    fn answered(
        &mut self,
        client: usize,
        key: usize,
        result: Result<Lease, LockError>,
        free_by: Option<Instant>,
        answered: Instant,
    ) {
        match result {
            Ok(lease) => {
                self.granted(key, client, lease, answered, None);
            }
            Err(e) => self.refused(key, &e, free_by, answered),
        }
    }

    fn refused(&mut self, key: usize, error: &LockError, free_by: Option<Instant>, at: Instant) {
        let redis = !self.nodes.is_empty();
        match error {
            LockError::Taken { .. } => {}
            LockError::NoQuorum { .. } | LockError::TooSlow { .. } if redis => {}
            other => panic!("unexpected answer to an acquisition of key {key}: {other}"),
        }
        stats::add(&stats::REFUSED);
        if let (LockError::Taken { .. }, Some(by)) = (error, free_by) {
            assert!(
                !self.model.must_be_free(key, by),
                "key {key} refused ({error}) while no lease could hold it"
            );
        }
        if redis {
            self.model.dirty(key, at);
        }
    }

    /// The explicit lease that `index` picks among the active ones.
    fn pick(&self, index: Index) -> Option<usize> {
        let active: Vec<usize> = (0..self.model.held.len())
            .filter(|i| self.model.held[*i].active)
            .collect();
        (!active.is_empty()).then(|| active[index.index(active.len())])
    }

    fn extend(&mut self, index: Index) {
        let Some(i) = self.pick(index) else { return };
        let locks = self.clients[self.model.held[i].client].clone();
        let mut lease = self.model.held[i].lease.clone();
        let result = self
            .rt
            .block_on(Explicit(Box::pin(locks.extend(&mut lease))));
        let answered = Instant::now();
        match result {
            Ok(()) => {
                let up: Vec<bool> = (self.model.node_state.iter())
                    .map(|n| *n == Node::Up)
                    .collect();
                let held = &mut self.model.held[i];
                held.lease = lease;
                // A node that did not answer keeps the old expiry.
                for (holder, up) in held.holders.iter_mut().zip(up) {
                    *holder &= up;
                }
            }
            Err(e) => {
                self.model.check_expired(&self.model.held[i], &e, answered);
                if let LockError::Expired { .. } = e {
                    self.model.held[i].active = false;
                }
            }
        }
        self.model.held[i].last_touch = answered;
    }

    fn unlock(&mut self, index: Index) {
        let Some(i) = self.pick(index) else { return };
        let locks = self.clients[self.model.held[i].client].clone();
        let lease = self.model.held[i].lease.clone();
        let result = self.rt.block_on(locks.unlock(lease));
        self.unlocked(i, result, Instant::now());
    }

    fn unlocked(&mut self, i: usize, result: Result<(), LockError>, answered: Instant) {
        let (key, lease) = (self.model.held[i].key, self.model.held[i].lease.clone());
        self.model.held[i].active = false;
        match result {
            Ok(()) => {
                self.check_released(key, &lease);
                self.model.held[i].released = true;
            }
            Err(e) => {
                self.model.check_expired(&self.model.held[i], &e, answered);
                // Whatever answered deleted it there.
                let up: Vec<bool> = (self.model.node_state.iter())
                    .map(|n| *n == Node::Up)
                    .collect();
                for (holder, up) in self.model.held[i].holders.iter_mut().zip(up) {
                    *holder &= !up;
                }
            }
        }
    }

    /// A waiter parks on a held key, then the holder releases: the waiter gets the key
    /// before the released lease would have run out (woken by the release, not by a timer).
    fn wait_for_release(&mut self, client: usize, index: Index) {
        let Some(i) = self.pick(index) else { return };
        let (key, holder) = (self.model.held[i].key, self.model.held[i].client);
        // On Redis a waiter of the holder's own client queues in process and sets no mark
        // the test could see; the other client is used.
        let client = if self.nodes.is_empty() {
            client
        } else {
            1 - holder
        };
        let until = self.model.held[i].valid_until();
        let ttl = self.ttl_now();
        let strict = until.saturating_duration_since(Instant::now()) >= ttl / 2
            && self.model.protected(&self.model.held[i])
            && self.model.free_but(key, Instant::now(), Some(i));
        let waiter = self.clients[client].clone();
        let res = resource(key);
        let max_wait = until.saturating_duration_since(Instant::now()) + ttl;
        let task = self.rt.spawn(async move {
            let result = waiter.acquire(LockRequest::new(&res).wait(max_wait)).await;
            (result, Instant::now())
        });
        let inspector = self.clients[holder].clone();
        let res = resource(key);
        let parked = self.rt.block_on(crate::support::eventually(ttl / 4, || {
            let (inspector, res) = (inspector.clone(), res.clone());
            async move { inspector.inspect(&res).await.is_ok_and(|seen| seen.waiters) }
        }));
        let locks = self.clients[holder].clone();
        let lease = self.model.held[i].lease.clone();
        let released = self.rt.block_on(locks.unlock(lease));
        let released_ok = released.is_ok();
        self.unlocked(i, released, Instant::now());
        let (result, got_at) = self.rt.block_on(task).unwrap();
        if strict && parked && released_ok {
            stats::add(&stats::WAKE_CHECKS);
            match &result {
                Ok(_) => assert!(
                    got_at < until,
                    "the waiter on key {key} got it only {:?} after the released lease's end",
                    got_at - until
                ),
                Err(e) => panic!("the waiter on key {key} was not woken by the release: {e}"),
            }
        }
        self.answered(client, key, result, None, got_at);
    }

    fn guard(&mut self, client: usize, key: usize) {
        let locks = self.clients[client].clone();
        let (status_tx, status_rx) = oneshot::channel::<LeaseStatus>();
        let (stop, stopped) = oneshot::channel::<()>();
        let renewal = Renewal::default().every(self.ttl_now() / 4);
        let res = resource(key);
        self.renewing(key);
        let start = Instant::now();
        let task = self.rt.spawn(async move {
            let work = |status| async move {
                let _ = status_tx.send(status);
                let _ = stopped.await;
            };
            locks.with_lock(LockRequest::new(&res), renewal, work).await
        });
        let status = self.rt.block_on(status_rx).ok();
        let answered = Instant::now();
        match status {
            Some(status) => {
                let lease = status.lease().clone();
                let held = self.granted(key, client, lease, answered, Some(status));
                self.guards.push(Guard {
                    held,
                    stop: Some(stop),
                    task,
                });
            }
            None => {
                let result = self.rt.block_on(task).unwrap();
                let error = result.expect_err("with_lock gave no status but returned Ok");
                self.refused(key, &error, Some(start), answered);
                self.closed(key);
            }
        }
    }

    fn end_guard(&mut self, index: Index) {
        if self.guards.is_empty() {
            return;
        }
        let mut guard = self.guards.remove(index.index(self.guards.len()));
        drop(guard.stop.take());
        let bound = self.ttl_now() * 4;
        let ended = self
            .rt
            .block_on(async { tokio::time::timeout(bound, &mut guard.task).await });
        let answered = Instant::now();
        let result = ended
            .expect("with_lock did not return once its work ended")
            .unwrap();
        let i = guard.held;
        let key = self.model.held[i].key;
        let lost = self.model.held[i]
            .status
            .as_ref()
            .is_some_and(LeaseStatus::is_lost);
        self.model.held[i].renewing = false;
        self.model.held[i].last_touch = answered;
        self.closed(key);
        match result {
            // The work ended while the lease held: `with_lock` released it.
            Ok(()) if !lost && self.model.protected(&self.model.held[i]) => {
                let lease = self.model.held[i].lease.clone();
                self.check_released(key, &lease);
                self.model.held[i].released = true;
            }
            Ok(()) | Err(LockError::Lost) => {}
            Err(e) => panic!("with_lock ended with {e}"),
        }
    }

    /// A request through a `LockLayer` whose handler takes the same key again (reentry),
    /// releases and extends that copy (which must do nothing), and checks from another
    /// task that the key is still taken.
    fn request(&mut self, client: usize, key: usize) {
        let locks = self.clients[client].clone();
        let other = self.clients[1 - client].clone();
        let ttl = self.ttl_now();
        let notes: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen: Arc<Mutex<Option<(Lease, Instant)>>> = Arc::default();
        let handler = {
            let (locks, notes, seen) = (locks.clone(), notes.clone(), seen.clone());
            service_fn(move |request: Request<RequestBody<Empty<Bytes>>>| {
                let (locks, other) = (locks.clone(), other.clone());
                let (notes, seen) = (notes.clone(), seen.clone());
                async move {
                    let entered = Instant::now();
                    let note = |n: String| notes.lock().unwrap().push(n);
                    let Some(status) = request.extensions().get::<LeaseStatus>().cloned() else {
                        note("no LeaseStatus in the request".into());
                        return Ok::<_, Infallible>(Response::new(Full::default()));
                    };
                    let own = status.lease().clone();
                    *seen.lock().unwrap() = Some((own.clone(), entered));
                    let res = resource(key);
                    let again = [
                        locks.try_lock(&res).await,
                        locks.acquire(LockRequest::new(&res).wait(ttl)).await,
                    ];
                    for copy in again {
                        match copy {
                            Ok(mut copy) if copy.token() == own.token() => {
                                let extended = locks.extend(&mut copy).await;
                                let released = locks.unlock(copy).await;
                                if extended.is_err() || released.is_err() {
                                    note(format!("reentered copy: {extended:?} {released:?}"));
                                }
                            }
                            Ok(_) => note("reentry gave another lease".into()),
                            Err(e) => note(format!("reentry refused: {e}")),
                        }
                    }
                    // Another request (another task) still finds it taken.
                    let res = resource(key);
                    let outside = tokio::spawn(async move { other.try_lock(&res).await });
                    if let Ok(Ok(lease)) = outside.await {
                        note(format!(
                            "taken from another task inside the layer: {lease:?}"
                        ));
                    }
                    Ok(Response::new(Full::new(Bytes::from_static(b"done"))))
                }
            })
        };
        let service = LockLayer::by_fn(|_: &http::request::Parts| Some("x".to_owned()))
            .scope(scope(key))
            .backend(locks)
            .layer(handler);
        self.renewing(key);
        let start = Instant::now();
        let status = self.rt.block_on(async move {
            let response = service.oneshot(Request::new(Empty::new())).await.unwrap();
            let status = response.status();
            let _ = response.into_body().collect().await;
            status
        });
        let answered = Instant::now();
        let notes = std::mem::take(&mut *notes.lock().unwrap());
        assert!(notes.is_empty(), "inside the layer on key {key}: {notes:?}");
        match status {
            StatusCode::OK => {
                let (lease, entered) = seen.lock().unwrap().take().expect("the handler ran");
                let i = self.granted(key, client, lease.clone(), entered, None);
                self.model.held[i].active = false;
                self.model.held[i].last_touch = answered;
                self.check_released(key, &lease);
                self.model.held[i].released = true;
                if self.model.node_state.iter().any(|n| *n != Node::Up) {
                    self.model.dirty(key, answered);
                }
            }
            StatusCode::LOCKED => {
                let taken = LockError::Taken {
                    retry_after: Duration::ZERO,
                };
                self.refused(key, &taken, Some(start), answered);
            }
            StatusCode::SERVICE_UNAVAILABLE if !self.nodes.is_empty() => {
                self.model.dirty(key, answered);
            }
            other => panic!("the layer on key {key} answered {other}"),
        }
        self.closed(key);
    }
}
