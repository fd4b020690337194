//! What the model reads besides the API's answers: the renewals the crate sends (counted
//! from its `tower_redlock.extend` spans), and what each Redis node stores (read over a
//! direct connection of its own).

use std::cell::Cell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing_subscriber::layer::{Context as LayerContext, Layer, SubscriberExt};

thread_local! {
    /// Set while the test itself polls an extension (a step `Extend`), so that only the
    /// renewals a watchdog sends are counted.
    static EXPLICIT: Cell<bool> = const { Cell::new(false) };
}

/// The extensions sent by anyone but the test, per key scope (`k0`, `k1`, ...).
#[derive(Default)]
pub struct Renewals {
    by_scope: Mutex<HashMap<String, u64>>,
}

impl Renewals {
    /// How many renewals of the key with `scope` were started so far.
    pub fn of(&self, scope: &str) -> u64 {
        self.by_scope
            .lock()
            .unwrap()
            .get(scope)
            .copied()
            .unwrap_or(0)
    }

    /// Counts the renewals of this thread's spans from now until the guard is dropped: the
    /// test's runtime is current-thread, so every watchdog runs here.
    pub fn install(self: &Arc<Self>) -> tracing::subscriber::DefaultGuard {
        let subscriber = tracing_subscriber::registry().with(Counter(self.clone()));
        tracing::subscriber::set_default(subscriber)
    }
}

struct Counter(Arc<Renewals>);

struct Scope(Option<String>);

impl Visit for Scope {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "scope" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "scope" {
            self.0 = Some(format!("{value:?}").trim_matches('"').to_owned());
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Counter {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: LayerContext<'_, S>) {
        if attrs.metadata().name() != "tower_redlock.extend" || EXPLICIT.with(Cell::get) {
            return;
        }
        let mut scope = Scope(None);
        attrs.record(&mut scope);
        let scope = scope.0.unwrap_or_default();
        *self.0.by_scope.lock().unwrap().entry(scope).or_default() += 1;
    }
}

/// A future whose polls are the test's own extension (not counted as renewals).
pub struct Explicit<F>(pub Pin<Box<F>>);

impl<F: Future> Future for Explicit<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        EXPLICIT.with(|flag| flag.set(true));
        let polled = self.0.as_mut().poll(cx);
        EXPLICIT.with(|flag| flag.set(false));
        polled
    }
}

/// The value of `key` on the node at `url` (`None` inside: no such key), or `None` when
/// the node did not answer within 300 ms.
pub async fn get(url: &str, key: &str) -> Option<Option<String>> {
    let read = async {
        let client = redis::Client::open(url).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("GET")
            .arg(key)
            .query_async::<Option<String>>(&mut conn)
            .await
            .ok()
    };
    tokio::time::timeout(Duration::from_millis(300), read)
        .await
        .ok()
        .flatten()
}

/// The fencing counter of `lock_key` on the node at `url`: 0 when unset, `None` when the
/// node did not answer.
pub async fn counter(url: &str, prefix: &str, lock_key: &str) -> Option<u64> {
    let value = get(url, &format!("{prefix}{{{lock_key}}}:fence")).await?;
    Some(value.and_then(|v| v.parse().ok()).unwrap_or(0))
}
