//! Errors of the lock backends.

use std::fmt;
use std::time::Duration;

use crate::key::KeyError;

/// Why a lock operation did not succeed; each variant says what the caller can do next
/// ([`LockLayer`](crate::LockLayer) maps each one to a response).
///
/// A lock never taken and a lease lost read apart, by variant and by text: an acquisition
/// fails with [`Taken`](Self::Taken) (someone else holds it), or
/// [`NoQuorum`](Self::NoQuorum) / [`TooSlow`](Self::TooSlow) naming
/// [`LockOperation::Acquire`] ("... so the lock was not acquired"); a renewal or release
/// of a lease that is gone fails with [`Expired`](Self::Expired) ("the lease was lost
/// ..."), and a layer whose lease was lost while the work ran with
/// [`Lost`](Self::Lost). A renewal or release that the nodes leave undecided is
/// [`NoQuorum`](Self::NoQuorum) naming [`LockOperation::Extend`] or
/// [`LockOperation::Release`]: the lease may still hold.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another holder has the lock, so it was not acquired: the nodes that said "held"
    /// leave too few for a quorum. `retry_after`, sent as `Retry-After`, is an upper bound
    /// on when a quorum is free again, from the holders' remaining TTL (`PTTL`).
    #[error(
        "the lock is held by another holder, so it was not acquired; it frees in at most {retry_after:?}"
    )]
    Taken {
        /// Time until the holder's lease expires.
        retry_after: Duration,
    },

    /// The answers that came in time decide nothing: fewer than a quorum answered, or the
    /// failed nodes could still hold the token on a quorum. `operation` says what was
    /// undecided: an acquisition took nothing (what it set is released); an extension or
    /// a release may have left the lease held. Retry later; check the nodes.
    #[error("no quorum to {operation}: {} of {nodes} nodes failed, and the other answers ({quorum} needed) decide nothing ({})", failures.len(), failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    NoQuorum {
        /// What was asked of the nodes.
        operation: LockOperation,
        /// How many nodes must agree.
        quorum: usize,
        /// How many nodes there are.
        nodes: usize,
        /// The nodes that failed, and why.
        failures: Vec<NodeFailure>,
    },

    /// A quorum agreed so late that no validity was left (`ttl - elapsed - drift` ≤ 0): an
    /// acquisition released the keys again, so the lock was not acquired; an extension
    /// left the lease as it was, whose validity ends as before. The nodes or network are
    /// slow: raise the TTL or lower the node timeout.
    #[error(
        "too slow to {operation}: it took {elapsed:?}, leaving no validity within the TTL; raise the TTL or lower the node timeout"
    )]
    TooSlow {
        /// What was asked of the nodes: [`LockOperation::Acquire`] or
        /// [`LockOperation::Extend`].
        operation: LockOperation,
        /// How long the attempt took.
        elapsed: Duration,
    },

    /// The lease was lost before this renewal or release: its token is gone (its TTL ran
    /// out, or [`force_unlock`](crate::Locks::force_unlock) deleted it), and nothing was
    /// extended or released. Said only when N - quorum + 1 nodes answered that the token
    /// is gone. Work done after its validity ended was not protected.
    #[error("the lease was lost before this renewal or release: its token is gone (expired or force-unlocked){}", if *taken_over { ", and another holder has the key now" } else { "" })]
    Expired {
        /// Whether another holder now has the key.
        taken_over: bool,
    },

    /// The lease was lost while the protected work ran (a renewal found the token gone, or
    /// the validity ended unrenewed); the work was not polled again.
    #[error("the lease was lost while the work ran; the work was stopped")]
    Lost,

    /// The key cannot be used; see [`KeyError`].
    #[error(transparent)]
    InvalidKey(#[from] KeyError),

    /// The [`LockRequest`](crate::LockRequest) asks for what no backend does (such as a
    /// set of keys in another mode than plain); retrying does not help.
    #[error("unsupported lock request: {0}")]
    Unsupported(&'static str),

    /// The handle is the in-process fallback ([`Locks::default`](crate::Locks::default)
    /// with no default chosen), and this process built a [`Redlock`](crate::Redlock):
    /// locking in process would let each replica take the same key, so it refuses. Give
    /// the layer or the state the `Redlock`, or call
    /// [`Locks::set_default`](crate::Locks::set_default) once at start-up; for in-process
    /// locks beside Redis, use `Locks::from(MemoryLocks::new())`. The layers answer 500.
    #[error(
        "no lock backend was chosen (Locks::default() is the in-process fallback) and this process built a Redlock, with which each replica would lock on its own; use the Redlock, or call Locks::set_default(..) once at start-up"
    )]
    NoBackendChosen,
}

/// What a lock operation asked of the nodes, as [`LockError::NoQuorum`] and
/// [`LockError::TooSlow`] name it. Its `Display` is what the error says was undecided:
/// "acquire the lock (it was not acquired)", "extend the lease (it may still hold)", ...
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockOperation {
    /// An acquisition ([`Locks::acquire`](crate::Locks::acquire) and the like, a layer's,
    /// an extractor's): nothing was taken.
    Acquire,
    /// An extension ([`Locks::extend`](crate::Locks::extend), a renewal): the lease may
    /// still hold, until its validity ends.
    Extend,
    /// A release ([`Locks::unlock`](crate::Locks::unlock), a layer's): what is left
    /// expires by its TTL.
    Release,
    /// [`Locks::inspect`](crate::Locks::inspect).
    Inspect,
    /// [`Locks::force_unlock`](crate::Locks::force_unlock).
    ForceUnlock,
}

impl fmt::Display for LockOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockOperation::Acquire => "acquire the lock (it was not acquired)",
            LockOperation::Extend => "extend the lease (it may still hold until its validity ends)",
            LockOperation::Release => "release the lease (what is left behind expires by its TTL)",
            LockOperation::Inspect => "inspect the lock",
            LockOperation::ForceUnlock => "force-unlock the lock",
        })
    }
}

impl LockError {
    /// The holder's remaining TTL when the lock is taken (for `Retry-After`), else `None`.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LockError::Taken { retry_after } => Some(*retry_after),
            _ => None,
        }
    }
}

/// One node that did not answer a lock operation.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NodeFailure {
    /// The node's address (`host:port`), without credentials.
    pub node: String,
    /// What went wrong.
    pub reason: NodeFailureReason,
}

/// Why a node did not answer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum NodeFailureReason {
    /// No answer within the node timeout.
    Timeout(Duration),
    /// The connection or the command failed.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    Redis(redis::RedisError),
    /// The lock's fencing counter on this node (`<prefix>{<lock key>}:fence`) is not a
    /// decimal integer below 2^53: another client wrote it. Delete it to use the node
    /// again.
    InvalidFencingCounter {
        /// The counter's key.
        key: String,
    },
    /// The node wrote, but fewer acknowledgements came within the replica timeout than
    /// [`Node::wait_for_replicas`](crate::Node::wait_for_replicas) and
    /// [`Node::wait_for_fsync`](crate::Node::wait_for_fsync) ask for, so it did not grant
    /// the write (replicas down, lagging, or fewer than asked for).
    NotAcknowledged {
        /// The replicas that acknowledged (`WAIT`'s answer).
        replicas: u32,
        /// The replicas asked for.
        wanted: u32,
        /// Whether the primary's AOF had it on disk (`WAITAOF`), or was not asked.
        fsynced: bool,
    },
}

#[cfg(feature = "redis")]
impl From<redis::RedisError> for NodeFailureReason {
    fn from(e: redis::RedisError) -> Self {
        NodeFailureReason::Redis(e)
    }
}

impl fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.node)?;
        match &self.reason {
            NodeFailureReason::Timeout(t) => write!(f, "no answer within {t:?}"),
            #[cfg(feature = "redis")]
            NodeFailureReason::Redis(e) => write!(f, "{e}"),
            NodeFailureReason::InvalidFencingCounter { key } => write!(
                f,
                "the fencing counter {:?} does not hold an integer below 2^53 (written by another client?); delete it",
                crate::redact::LogKey(key)
            ),
            NodeFailureReason::NotAcknowledged {
                replicas,
                wanted,
                fsynced,
            } => {
                f.write_str("the write was ")?;
                if *wanted > 0 {
                    write!(f, "acknowledged by {replicas} of the {wanted} replicas")?;
                    write!(f, " asked for{}", if *fsynced { "" } else { ", and " })?;
                }
                if !fsynced {
                    f.write_str("not fsynced by the primary")?;
                }
                f.write_str(" within the replica timeout")
            }
        }
    }
}

/// What is wrong with a [`RedlockBuilder`](crate::RedlockBuilder) or
/// [`MemoryLocks`](crate::MemoryLocks) configuration, a client-IP key's trusted proxies
/// or prefix lengths, or the choice of a default backend.
///
/// Its `Debug` is its `Display` text, so that a `main` that returns it through `?` (as
/// `Result<(), Box<dyn std::error::Error>>`) prints the message and the fix, not the
/// variant's fields.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No node was given: pass at least one Redis URL (1, 3 or 5 independent masters).
    #[error("no Redis nodes were given: pass at least one redis:// URL")]
    NoNodes,
    /// A Redis URL could not be parsed, or redis-rs refused a `Node`'s settings.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error("invalid Redis URL for node {index}: {source}")]
    InvalidUrl {
        /// Position of the URL (or node) in the list, from 0.
        index: usize,
        /// What redis-rs reported.
        source: redis::RedisError,
    },
    /// The TTL is zero, leaves no validity after clock drift, or is over the maximum.
    #[error("invalid TTL {ttl:?}: {reason}")]
    InvalidTtl {
        /// The TTL given.
        ttl: Duration,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The node timeout is zero or not shorter than the TTL.
    #[error(
        "invalid node timeout {timeout:?}: it must be above zero and shorter than the TTL {ttl:?}"
    )]
    InvalidNodeTimeout {
        /// The timeout given.
        timeout: Duration,
        /// The TTL it was checked against.
        ttl: Duration,
    },
    /// A node's [`replica_timeout`](crate::Node::replica_timeout) is zero, or does not
    /// fit in the node timeout, which bounds the whole operation, with `margin` to spare:
    /// Redis notices that a `WAIT` (or `WAITAOF`) has timed out only at its next periodic
    /// check, up to 100 ms later (`hz 10`), so a refusal can take the replica timeout plus
    /// 100 ms per waiting command.
    #[error(
        "invalid replica timeout {timeout:?} for node {index} (the default is half the node timeout): it must be above zero, and it plus {margin:?} shorter than the node timeout {node_timeout:?}, since Redis answers a WAIT that timed out up to 100 ms late (hz 10); lower it below {:?} or raise the node timeout", node_timeout.saturating_sub(*margin)
    )]
    InvalidReplicaTimeout {
        /// Position of the node in the list, from 0.
        index: usize,
        /// The replica timeout.
        timeout: Duration,
        /// The node timeout it was checked against.
        node_timeout: Duration,
        /// What a refusal may take beyond the replica timeout: 100 ms for each of `WAIT`
        /// and `WAITAOF` that the node sends.
        margin: Duration,
    },
    /// The clock drift factor is not a finite number in `[0, 0.5)`.
    #[error(
        "invalid clock drift factor {0}: use a finite number from 0 up to (not including) 0.5, such as 0.01"
    )]
    InvalidDriftFactor(f64),
    /// The retry delay range is empty (minimum above maximum).
    #[error("invalid retry delay: minimum {min:?} is above maximum {max:?}")]
    InvalidRetryDelay {
        /// Smallest delay.
        min: Duration,
        /// Largest delay.
        max: Duration,
    },
    /// The key prefix contains control bytes or is longer than 128 bytes.
    #[error("invalid key prefix: {0}")]
    InvalidPrefix(KeyError),
    /// The key prefix contains `{` or `}`, a Redis Cluster hash tag: the crate names a
    /// lock's own keys `<prefix>{<lock key>}:<role>` (see [`key`](crate::key)).
    #[error(
        "invalid key prefix {0:?}: it contains '{{' or '}}', which would make a Redis Cluster hash tag (the crate names a lock's own keys <prefix>{{<lock key>}}:<role>); pick a prefix without braces"
    )]
    BraceInPrefix(String),

    /// The store was built with `require_nodes_at_start(true)`
    /// ([`RedlockBuilder::require_nodes_at_start`](crate::RedlockBuilder::require_nodes_at_start),
    /// and the limiters' builders) and fewer nodes than it needs (a Redlock's quorum, a
    /// limiter's one node) answered `PING` within the node timeout while it was built.
    /// Check the URLs and that the nodes run; without the option, `build` starts anyway
    /// and logs a warning per node.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error(
        "{} of {nodes} Redis nodes answered at start-up and {needed} are needed (require_nodes_at_start): {}",
        nodes.saturating_sub(failures.len()),
        failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    NodesUnreachable {
        /// How many nodes there are.
        nodes: usize,
        /// How many must answer: the quorum.
        needed: usize,
        /// The nodes that did not answer, and why.
        failures: Vec<NodeFailure>,
    },

    /// [`Locks::set_default`](crate::Locks::set_default) (or the limiters' `set_default`)
    /// was called after the default was chosen: by an earlier call, or by a layer built
    /// before it, which takes the default as it is built.
    #[error(
        "the default {handle} backend was already chosen: call {handle}::set_default once at start-up, before building any layer of its kind"
    )]
    DefaultAlreadyChosen {
        /// The handle whose default it is: `"Locks"`, `"RateLimiter"` or
        /// `"ConcurrencyLimiter"`.
        handle: &'static str,
    },
    /// A trusted proxy range given to
    /// [`ClientIpKey::trusted_proxies`](crate::key::ClientIpKey::trusted_proxies) is neither
    /// an address with a prefix length (CIDR notation: RFC 4632, section 3.1; RFC 4291,
    /// section 2.3) nor a single address.
    #[cfg(feature = "client-ip")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client-ip")))]
    #[error(
        "invalid trusted proxy range {0:?}: write an address with a prefix length, such as 10.0.0.0/8 or 2001:db8::/32, or a single address, such as 192.0.2.10"
    )]
    InvalidProxyRange(String),
    /// A prefix length that groups client addresses
    /// ([`ClientIpKey::ipv4_prefix`](crate::key::ClientIpKey::ipv4_prefix),
    /// [`ipv6_prefix`](crate::key::ClientIpKey::ipv6_prefix)) is longer than the address.
    #[cfg(feature = "client-ip")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client-ip")))]
    #[error("invalid {family} prefix length /{len}: it is at most /{max}")]
    InvalidPrefixLength {
        /// `"IPv4"` or `"IPv6"`.
        family: &'static str,
        /// The length given, in bits.
        len: u8,
        /// The longest accepted, in bits: 32 or 128.
        max: u8,
    },
}

impl fmt::Debug for ConfigError {
    /// The `Display` text: what a `main` that returns the error prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `main` prints for an error it returns: `Error: ` and the error's `Debug`.
    fn as_main_prints(error: ConfigError) -> String {
        let error: Box<dyn std::error::Error> = Box::new(error);
        format!("Error: {error:?}")
    }

    #[test]
    fn a_config_error_returned_from_main_prints_its_message() {
        let ttl = ConfigError::InvalidTtl {
            ttl: Duration::ZERO,
            reason: "it is zero",
        };
        assert_eq!(format!("{ttl:?}"), ttl.to_string());
        assert_eq!(
            as_main_prints(ConfigError::DefaultAlreadyChosen { handle: "Locks" }),
            "Error: the default Locks backend was already chosen: call Locks::set_default once \
             at start-up, before building any layer of its kind"
        );
    }

    #[cfg(feature = "redis")]
    #[test]
    fn an_invalid_url_prints_the_node_and_redis_rs_reason_not_its_fields() {
        let source = redis::Client::open("http://not-redis").unwrap_err();
        let reason = source.to_string();
        let printed = as_main_prints(ConfigError::InvalidUrl { index: 0, source });
        assert_eq!(
            printed,
            format!("Error: invalid Redis URL for node 0: {reason}")
        );
        assert!(!printed.contains("InvalidUrl {"), "{printed}");
    }
}
