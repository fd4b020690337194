//! Reentrancy within a request: while a [`LockLayer`](crate::LockLayer)'s inner service
//! is polled, the lease the layer holds is in a scope of that poll, and an acquisition of the same
//! keys on the same backend from that code (the handler, its extractors, `with_lock` in it)
//! gets that lease back instead of refusing itself (409/423) or waiting for itself.
//!
//! The lease handed back is marked: releasing or extending it does nothing, and the layer,
//! the outermost holder, releases the lease when the response is done. The scope is the
//! task that polls the inner service: a task the handler spawns is another request.

use std::cell::Cell;
use std::sync::Arc;

use crate::lease::Lease;
use crate::lock::status::LeaseStatus;

thread_local! {
    /// The lease of the `LockLayer` whose inner service this thread is polling: set for
    /// the poll only, as a task-local would be (a poll runs on one thread, start to end).
    static HELD: Cell<Option<LeaseStatus>> = const { Cell::new(None) };
    /// Whether `HELD` may hold a lease: a flag without a destructor, so that the common
    /// case (no lease in scope) costs one read.
    static IN_SCOPE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with `status`'s lease as the request's own, and puts back what was there (the
/// lease of an outer layer), also when `f` panics.
pub(crate) fn scoped<R>(status: LeaseStatus, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<LeaseStatus>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = HELD.try_with(|held| held.replace(self.0.take()));
            IN_SCOPE.set(self.1);
        }
    }
    let Ok(outer) = HELD.try_with(|held| held.replace(Some(status))) else {
        // The thread is exiting: no scope, nothing to reenter.
        return f();
    };
    let _restore = Restore(outer, IN_SCOPE.replace(true));
    f()
}

/// The request's own lease, when it holds every one of `keys` on the backend `backend`
/// (an exclusive lease covers any mode asked for; a reader's covers nothing): a copy
/// marked as reentered, with the validity the renewals have reached.
pub(crate) fn held(backend: u64, keys: &[Arc<str>]) -> Option<Lease> {
    if !IN_SCOPE.get() {
        return None;
    }
    HELD.try_with(|held| {
        let status = held.take()?;
        let found = reentered(&status, backend, keys);
        held.set(Some(status));
        found
    })
    .ok()
    .flatten()
}

fn reentered(status: &LeaseStatus, backend: u64, keys: &[Arc<str>]) -> Option<Lease> {
    let lease = status.lease();
    // A reader's lease does not cover a writer; a lost one covers nothing.
    if lease.backend != backend || lease.is_shared() || status.is_lost() {
        return None;
    }
    let covered = keys
        .iter()
        .all(|key| lease.keys().any(|held| held == &**key));
    covered.then(|| {
        let mut lease = lease.clone();
        lease.reentered = true;
        lease.valid_until = status.valid_until();
        lease
    })
}
