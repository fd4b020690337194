//! Every Lua script of the Redis backends, in one place: the Redlock's, the rate limiter's
//! and the concurrency limiter's.
//!
//! Each script's source is a file under `src/backend/lua/`, whose opening comment gives its
//! KEYS, ARGV and reply. The helpers that several scripts share are Lua functions in
//! `src/backend/lua/lib/`, joined before the script's own file at compile time
//! (`concat!` of `include_str!`s): what is sent to Redis is those files as they are.
//!
//! A script is hashed (SHA-1) when first used and run by `EVALSHA`, loaded again where a
//! node answers `NOSCRIPT` (after a restart, say). The Redlock loads [`REDLOCK`] on each
//! new connection to a node, so that the first attempts find them there; the limiters'
//! stores load theirs on first use (redis-rs's `Script::invoke_async` on `NOSCRIPT`).

use std::ops::Deref;
use std::sync::OnceLock;

use redis::Script;

/// A Lua script of this crate: its source, and the [`Script`] (with its hash) made from it
/// on first use; it derefs to that.
#[derive(Debug)]
pub(crate) struct Lua {
    source: &'static str,
    script: OnceLock<Script>,
}

impl Lua {
    const fn new(source: &'static str) -> Self {
        Self {
            source,
            script: OnceLock::new(),
        }
    }
}

impl Deref for Lua {
    type Target = Script;

    fn deref(&self) -> &Script {
        self.script.get_or_init(|| Script::new(self.source))
    }
}

/// Scripts loaded on every new connection of a node (see
/// [`Connection::new`](crate::backend::connection::Connection::new)).
pub(crate) type Scripts = &'static [&'static Lua];

/// The Redlock's scripts, loaded on each node when its connection opens.
#[cfg(feature = "lock")]
pub(crate) static REDLOCK: Scripts = &[
    &RELEASE,
    &ACQUIRE,
    &ACQUIRE_FENCED,
    &SHARED_ACQUIRE,
    &EXCLUSIVE_ACQUIRE,
    &SHARED_EXTEND,
    &SHARED_RELEASE,
    &FAIR_ACQUIRE,
    &FAIR_LEAVE,
    &ACQUIRE_ALL,
    &FENCE_ALL,
    &EXTEND_ALL,
    &RELEASE_ALL,
    &INSPECT,
    &FORCE_RELEASE,
    #[cfg(feature = "idempotency")]
    &IDEMPOTENCY_BEGIN,
    #[cfg(feature = "idempotency")]
    &IDEMPOTENCY_FINISH,
];

// The Redlock: one key.

/// `lua/acquire.lua`: an attempt on one lock key, `SET NX PX` or the holder's `PTTL`.
#[cfg(feature = "lock")]
pub(crate) static ACQUIRE: Lua = Lua::new(concat!(
    include_str!("lua/lib/mark.lua"),
    include_str!("lua/lib/set_holder.lua"),
    include_str!("lua/acquire.lua"),
));

/// `lua/acquire_fenced.lua`: [`ACQUIRE`] that reads (on one node, raises) the fencing
/// counter.
#[cfg(feature = "lock")]
pub(crate) static ACQUIRE_FENCED: Lua = Lua::new(concat!(
    include_str!("lua/lib/counter_valid.lua"),
    include_str!("lua/lib/mark.lua"),
    include_str!("lua/lib/set_holder.lua"),
    include_str!("lua/acquire_fenced.lua"),
));

/// `lua/release.lua`: deletes the lock key where it holds our token.
#[cfg(feature = "lock")]
pub(crate) static RELEASE: Lua = Lua::new(concat!(
    include_str!("lua/lib/unmark.lua"),
    include_str!("lua/lib/is_holder.lua"),
    include_str!("lua/release.lua"),
));

// The Redlock: shared and exclusive access.

/// `lua/shared_acquire.lua`: a reader's attempt.
#[cfg(feature = "lock")]
pub(crate) static SHARED_ACQUIRE: Lua = Lua::new(concat!(
    include_str!("lua/lib/now.lua"),
    include_str!("lua/lib/mark.lua"),
    include_str!("lua/lib/foreign.lua"),
    include_str!("lua/lib/keep_until_last.lua"),
    include_str!("lua/shared_acquire.lua"),
));

/// `lua/exclusive_acquire.lua`: a writer's attempt.
#[cfg(feature = "lock")]
pub(crate) static EXCLUSIVE_ACQUIRE: Lua = Lua::new(concat!(
    include_str!("lua/lib/now.lua"),
    include_str!("lua/lib/mark.lua"),
    include_str!("lua/lib/foreign.lua"),
    include_str!("lua/lib/is_token.lua"),
    include_str!("lua/lib/counter_valid.lua"),
    include_str!("lua/lib/set_holder.lua"),
    include_str!("lua/exclusive_acquire.lua"),
));

/// `lua/shared_extend.lua`: extends a reader.
#[cfg(feature = "lock")]
pub(crate) static SHARED_EXTEND: Lua = Lua::new(concat!(
    include_str!("lua/lib/now.lua"),
    include_str!("lua/lib/keep_until_last.lua"),
    include_str!("lua/shared_extend.lua"),
));

/// `lua/shared_release.lua`: releases a reader.
#[cfg(feature = "lock")]
pub(crate) static SHARED_RELEASE: Lua = Lua::new(concat!(
    include_str!("lua/lib/now.lua"),
    include_str!("lua/lib/unmark.lua"),
    include_str!("lua/shared_release.lua"),
));

// The Redlock: fair waiting.

/// `lua/fair_acquire.lua`: a fair attempt, in arrival order.
#[cfg(feature = "lock")]
pub(crate) static FAIR_ACQUIRE: Lua = Lua::new(concat!(
    include_str!("lua/lib/now.lua"),
    include_str!("lua/lib/mark.lua"),
    include_str!("lua/lib/foreign.lua"),
    include_str!("lua/lib/counter_valid.lua"),
    include_str!("lua/lib/set_holder.lua"),
    include_str!("lua/fair_acquire.lua"),
));

/// `lua/fair_leave.lua`: leaves the fair queue.
#[cfg(feature = "lock")]
pub(crate) static FAIR_LEAVE: Lua = Lua::new(concat!(
    include_str!("lua/lib/foreign.lua"),
    include_str!("lua/fair_leave.lua"),
));

// The Redlock: a set of keys (and the extension and write-back of one key).

/// `lua/acquire_all.lua`: takes every key of a set, or none.
#[cfg(feature = "lock")]
pub(crate) static ACQUIRE_ALL: Lua = Lua::new(concat!(
    include_str!("lua/lib/counter_valid.lua"),
    include_str!("lua/lib/set_holder.lua"),
    include_str!("lua/acquire_all.lua"),
));

/// `lua/fence_all.lua`: raises the fencing counters while every key holds our token.
#[cfg(feature = "lock")]
pub(crate) static FENCE_ALL: Lua = Lua::new(concat!(
    include_str!("lua/lib/counter_valid.lua"),
    include_str!("lua/fence_all.lua"),
));

/// `lua/extend_all.lua`: a new TTL on every key, if every one holds our token.
#[cfg(feature = "lock")]
pub(crate) static EXTEND_ALL: Lua = Lua::new(concat!(
    include_str!("lua/lib/counter_valid.lua"),
    include_str!("lua/lib/is_holder.lua"),
    include_str!("lua/extend_all.lua"),
));

/// `lua/release_all.lua`: deletes every key of a set that holds our token.
#[cfg(feature = "lock")]
pub(crate) static RELEASE_ALL: Lua = Lua::new(concat!(
    include_str!("lua/lib/unmark.lua"),
    include_str!("lua/lib/is_holder.lua"),
    include_str!("lua/release_all.lua"),
));

// The Redlock: inspection.

/// `lua/inspect.lua`: what one node holds for a lock.
#[cfg(feature = "lock")]
pub(crate) static INSPECT: Lua = Lua::new(concat!(
    include_str!("lua/lib/is_holder.lua"),
    include_str!("lua/inspect.lua"),
));

/// `lua/force_release.lua`: deletes the lock key whoever holds it.
#[cfg(feature = "lock")]
pub(crate) static FORCE_RELEASE: Lua = Lua::new(concat!(
    include_str!("lua/lib/unmark.lua"),
    include_str!("lua/lib/is_holder.lua"),
    include_str!("lua/force_release.lua"),
));

// The Redlock: idempotency records.

/// `lua/idempotency_begin.lua`: the record if there is one, else an attempt on the lock.
#[cfg(feature = "idempotency")]
pub(crate) static IDEMPOTENCY_BEGIN: Lua = Lua::new(concat!(
    include_str!("lua/lib/set_holder.lua"),
    include_str!("lua/idempotency_begin.lua"),
));

/// `lua/idempotency_finish.lua`: stores the record, then releases the lock.
#[cfg(feature = "idempotency")]
pub(crate) static IDEMPOTENCY_FINISH: Lua = Lua::new(concat!(
    include_str!("lua/lib/unmark.lua"),
    include_str!("lua/lib/is_holder.lua"),
    include_str!("lua/idempotency_finish.lua"),
));

// The rate limiter.

/// `lua/rate_fixed.lua`: a hit on a fixed-window counter.
#[cfg(feature = "rate-limit")]
pub(crate) static RATE_FIXED: Lua = Lua::new(include_str!("lua/rate_fixed.lua"));

/// `lua/rate_gcra.lua`: a GCRA decision.
#[cfg(feature = "rate-limit")]
pub(crate) static RATE_GCRA: Lua = Lua::new(include_str!("lua/rate_gcra.lua"));

// The concurrency limiter.

/// `lua/concurrency_acquire.lua`: takes a permit under the limit.
#[cfg(feature = "concurrency-limit")]
pub(crate) static CONCURRENCY_ACQUIRE: Lua = Lua::new(concat!(
    include_str!("lua/lib/mark.lua"),
    include_str!("lua/concurrency_acquire.lua"),
));

/// `lua/concurrency_release.lua`: gives back a permit.
#[cfg(feature = "concurrency-limit")]
pub(crate) static CONCURRENCY_RELEASE: Lua = Lua::new(concat!(
    include_str!("lua/lib/unmark.lua"),
    include_str!("lua/concurrency_release.lua"),
));

/// `lua/concurrency_renew.lua`: renews a live permit.
#[cfg(feature = "concurrency-limit")]
pub(crate) static CONCURRENCY_RENEW: Lua = Lua::new(include_str!("lua/concurrency_renew.lua"));

#[cfg(all(
    test,
    any(
        feature = "lock",
        feature = "rate-limit",
        feature = "concurrency-limit"
    )
))]
mod tests {
    use super::*;

    /// Every script, by name.
    fn every() -> Vec<(&'static str, &'static Lua)> {
        vec![
            #[cfg(feature = "lock")]
            ("acquire", &ACQUIRE),
            #[cfg(feature = "lock")]
            ("acquire_fenced", &ACQUIRE_FENCED),
            #[cfg(feature = "lock")]
            ("release", &RELEASE),
            #[cfg(feature = "lock")]
            ("shared_acquire", &SHARED_ACQUIRE),
            #[cfg(feature = "lock")]
            ("exclusive_acquire", &EXCLUSIVE_ACQUIRE),
            #[cfg(feature = "lock")]
            ("shared_extend", &SHARED_EXTEND),
            #[cfg(feature = "lock")]
            ("shared_release", &SHARED_RELEASE),
            #[cfg(feature = "lock")]
            ("fair_acquire", &FAIR_ACQUIRE),
            #[cfg(feature = "lock")]
            ("fair_leave", &FAIR_LEAVE),
            #[cfg(feature = "lock")]
            ("acquire_all", &ACQUIRE_ALL),
            #[cfg(feature = "lock")]
            ("fence_all", &FENCE_ALL),
            #[cfg(feature = "lock")]
            ("extend_all", &EXTEND_ALL),
            #[cfg(feature = "lock")]
            ("release_all", &RELEASE_ALL),
            #[cfg(feature = "lock")]
            ("inspect", &INSPECT),
            #[cfg(feature = "lock")]
            ("force_release", &FORCE_RELEASE),
            #[cfg(feature = "idempotency")]
            ("idempotency_begin", &IDEMPOTENCY_BEGIN),
            #[cfg(feature = "idempotency")]
            ("idempotency_finish", &IDEMPOTENCY_FINISH),
            #[cfg(feature = "rate-limit")]
            ("rate_fixed", &RATE_FIXED),
            #[cfg(feature = "rate-limit")]
            ("rate_gcra", &RATE_GCRA),
            #[cfg(feature = "concurrency-limit")]
            ("concurrency_acquire", &CONCURRENCY_ACQUIRE),
            #[cfg(feature = "concurrency-limit")]
            ("concurrency_release", &CONCURRENCY_RELEASE),
            #[cfg(feature = "concurrency-limit")]
            ("concurrency_renew", &CONCURRENCY_RENEW),
        ]
    }

    /// The functions of `lua/lib/`, each defined in the file of its name.
    const HELPERS: [(&str, &str); 9] = [
        ("mark", include_str!("lua/lib/mark.lua")),
        ("unmark", include_str!("lua/lib/unmark.lua")),
        ("foreign", include_str!("lua/lib/foreign.lua")),
        ("counter_valid", include_str!("lua/lib/counter_valid.lua")),
        ("is_token", include_str!("lua/lib/is_token.lua")),
        ("now_ms", include_str!("lua/lib/now.lua")),
        ("set_holder", include_str!("lua/lib/set_holder.lua")),
        ("is_holder", include_str!("lua/lib/is_holder.lua")),
        (
            "keep_until_last",
            include_str!("lua/lib/keep_until_last.lua"),
        ),
    ];

    /// `source` without its comments (none of the scripts has `--` in a string).
    fn code(source: &str) -> String {
        source
            .lines()
            .map(|line| line.split("--").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// How many times `code` calls or defines `name` (not as the end of a longer name).
    fn mentions(code: &str, name: &str) -> usize {
        let call = format!("{name}(");
        code.match_indices(&call)
            .filter(|(at, _)| {
                !code[..*at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            })
            .count()
    }

    #[test]
    fn each_script_joins_the_helpers_it_calls_and_no_other() {
        let scripts = every();
        assert!(!scripts.is_empty());
        for (name, lua) in scripts {
            let code = code(lua.source);
            for (helper, file) in HELPERS {
                let definition = format!("local function {helper}(");
                assert!(file.contains(&definition), "lib file of {helper}");
                let joined = lua.source.matches(file).count();
                let defined = code.matches(&definition).count();
                let called = mentions(&code, helper) - defined;
                assert!(
                    joined <= 1 && defined == joined,
                    "{name}: {helper} defined {defined} times"
                );
                assert_eq!(
                    called > 0,
                    joined == 1,
                    "{name}: {helper} called {called} times, joined {joined} times"
                );
            }
        }
    }

    #[cfg(feature = "idempotency")]
    #[test]
    fn the_finish_script_knows_a_record_by_its_magic() {
        use crate::idempotency::record::MAGIC;
        let check = format!("string.sub(r, 1, {}) == '{MAGIC}'", MAGIC.len());
        assert!(IDEMPOTENCY_FINISH.source.contains(&check), "{check}");
    }

    #[test]
    fn each_script_has_its_own_hash() {
        let mut hashes: Vec<&str> = every().iter().map(|(_, lua)| lua.get_hash()).collect();
        let count = hashes.len();
        hashes.sort_unstable();
        hashes.dedup();
        assert_eq!(hashes.len(), count);
    }
}
