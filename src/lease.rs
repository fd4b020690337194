//! Leases: what a successful acquisition hands back.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The two lowercase hex digits of every byte.
// Evaluated when the crate is compiled: an index out of bounds would fail the build.
#[allow(clippy::indexing_slicing)]
static HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0x0f]];
        byte += 1;
    }
    pairs
};

/// A value that names one acquisition, shown as 32 lowercase hex digits: on Redis 128
/// random bits (a CSPRNG seeded by the OS) stored as the lock key's value; in process
/// unique within the process. Only its holder can extend or release the lock, so a holder
/// whose lease ran out cannot delete the next holder's.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 32]);

impl Token {
    /// A token from `rand`'s thread-local CSPRNG (seeded by the OS; no system call).
    #[cfg(feature = "redis")]
    pub(crate) fn random() -> Self {
        use rand::RngCore;
        let mut raw = [0u8; 16];
        rand::rng().fill_bytes(&mut raw);
        Self::from_raw(raw)
    }

    /// A token unique within this process: a random prefix drawn (and hex-encoded) once,
    /// then a counter.
    pub(crate) fn unique() -> Self {
        use std::sync::OnceLock;
        use std::sync::atomic::{AtomicU64, Ordering};
        static PREFIX: OnceLock<Token> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let Token(mut hex) = *PREFIX.get_or_init(|| Self::from_raw(rand::random()));
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        hex_into(&mut hex[16..], &n.to_be_bytes());
        Token(hex)
    }

    fn from_raw(raw: [u8; 16]) -> Self {
        let mut hex = [0u8; 32];
        hex_into(&mut hex, &raw);
        Token(hex)
    }

    /// The token as 32 lowercase hex digits, as stored in Redis.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    #[cfg(feature = "redis")]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Writes `bytes` into `out` as lowercase hex, two digits a byte.
fn hex_into(out: &mut [u8], bytes: &[u8]) {
    for (pair, &byte) in out.chunks_exact_mut(2).zip(bytes) {
        // Always there: a byte indexes a table of 256.
        if let Some(hex) = HEX_PAIRS.get(usize::from(byte)) {
            pair.copy_from_slice(hex);
        }
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", self.as_str())
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A held lock: its key, its token, and the instant its validity ends.
///
/// Validity is `ttl - elapsed - drift` on this process's monotonic clock from the start of
/// the acquisition (see [`Redlock`](crate::Redlock)); past
/// [`valid_until`](Lease::valid_until), mutual exclusion is not guaranteed even if the keys
/// still exist. A lease is a snapshot: renewals do not move its copies' `valid_until`; a
/// [`LeaseStatus`](crate::LeaseStatus) follows them. Cloning copies the description; only
/// [`Locks::unlock`](crate::Locks::unlock) (or dropping the layer's or extractor's guard)
/// releases it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub(crate) key: Arc<str>,
    /// What it holds besides `key`.
    pub(crate) shape: Shape,
    pub(crate) token: Token,
    pub(crate) ttl: Duration,
    pub(crate) valid_until: Instant,
    /// Non-zero, so that a lease fits 128 bytes.
    pub(crate) fencing_token: Option<NonZeroU64>,
    /// Which backend instance issued it (see `backend::next_backend_id`).
    pub(crate) backend: u64,
    /// Handed back to a request that already held it (`lock::reentry`).
    pub(crate) reentered: bool,
}

impl Lease {
    /// The full key, as stored in Redis: `{prefix}{scope}:{value}`; the first in byte order
    /// for a lease on several keys ([`LockRequest::all`](crate::LockRequest::all)).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Every key this lease holds, in byte order (several for
    /// [`LockRequest::all`](crate::LockRequest::all)), all with the same token.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        match &self.shape {
            Shape::Set(keys) => &keys[..],
            Shape::Lock | Shape::Reader { .. } => std::slice::from_ref(&self.key),
        }
        .iter()
        .map(|key| &**key)
    }

    /// The token that proves ownership: on Redis, the lock key's value.
    pub fn token(&self) -> &Token {
        &self.token
    }

    /// The TTL the keys were set with.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The instant the validity ends (monotonic clock).
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// The fencing token of this acquisition: greater than every earlier acquisition's of
    /// the same key, so storage can refuse writes from a holder whose lease ran out.
    ///
    /// Present when the backend was built with `fencing_tokens(true)`
    /// ([`RedlockBuilder::fencing_tokens`](crate::RedlockBuilder::fencing_tokens),
    /// [`MemoryLocksBuilder::fencing_tokens`](crate::MemoryLocksBuilder::fencing_tokens)),
    /// except on a shared lease. See the [lock module docs](crate::lock#fencing-tokens).
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token.map(NonZeroU64::get)
    }

    /// The validity left now; zero once it has ended.
    pub fn remaining(&self) -> Duration {
        self.valid_until.saturating_duration_since(Instant::now())
    }

    /// Whether the validity has not ended yet.
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until
    }

    /// Whether this is a shared lease (a reader, see [`LockMode`](crate::LockMode)); its
    /// [`key`](Self::key) is then the readers' set `<prefix>{<lock key>}:readers`.
    pub fn is_shared(&self) -> bool {
        matches!(self.shape, Shape::Reader { .. })
    }
}

/// What a lease holds besides its [`key`](Lease::key), set when acquired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// One lock key: the lease's key.
    Lock,
    /// A reader of `lock`: the lease's key is the readers' set, `<prefix>{<lock>}:readers`.
    Reader { lock: Arc<str> },
    /// Several lock keys, sorted and distinct, held together; the lease's key is the first.
    Set(Arc<[Arc<str>]>),
}

/// Whether a lock is shared by readers, or taken by one holder while no reader holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Shared,
    Exclusive,
}

/// The key of a shared lease on `lock_key` (a key of the backend with `prefix`): its
/// readers' set, `<prefix>{<lock key>}:readers`.
pub(crate) fn readers_key(prefix: &str, lock_key: &str) -> Arc<str> {
    Arc::from(format!("{prefix}{{{lock_key}}}:readers"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_fits_128_bytes() {
        assert!(size_of::<Lease>() <= 128, "{} bytes", size_of::<Lease>());
    }

    #[test]
    fn readers_keys_name_their_lock_key() {
        let key = readers_key("tower-redlock:", "tower-redlock:/items:7");
        assert_eq!(&*key, "tower-redlock:{tower-redlock:/items:7}:readers");
    }

    #[test]
    fn tokens_are_hex_and_distinct() {
        assert_eq!(HEX_PAIRS[0x00], *b"00");
        assert_eq!(HEX_PAIRS[0xa7], *b"a7");
        assert_eq!(HEX_PAIRS[0xff], *b"ff");
        #[cfg(feature = "redis")]
        let (a, b) = (Token::random(), Token::random());
        #[cfg(not(feature = "redis"))]
        let (a, b) = (Token::unique(), Token::unique());
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
        assert!(a.as_str().bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn in_process_tokens_share_a_prefix_and_count_on() {
        let (a, b) = (Token::unique(), Token::unique());
        assert_eq!(a.as_str()[..16], b.as_str()[..16]);
        assert_ne!(a, b);
        assert!(b.as_str().bytes().all(|c| c.is_ascii_hexdigit()));
        let count = |t: &Token| u64::from_str_radix(&t.as_str()[16..], 16).unwrap();
        assert!(count(&b) > count(&a));
    }
}
