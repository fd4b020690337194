//! Replica acknowledgement: `WAIT` and `WAITAOF` in a granting write's pipeline.

use std::time::Duration;

use redis::{Cmd, Pipeline, RedisResult, Value};

use super::Node;

impl Node {
    /// Makes this node grant a lock only once `replicas` of its replicas have the write:
    /// after each write that takes or extends a lock, raises a fencing counter or stores
    /// an idempotency record, the node is sent `WAIT replicas timeout` in the same round
    /// trip (one pipeline, on a connection of its own, so that a blocking `WAIT` holds up
    /// no other command). Fewer acknowledgements within [`replica_timeout`] mean the node
    /// did not grant it: the operation counts as that node's failure
    /// ([`NodeFailureReason::NotAcknowledged`]) and the verdict follows the quorum rule as
    /// usual. When the attempt as a whole fails, what it wrote is deleted, as for any
    /// attempt that fell short; when the other nodes still make a quorum, the key stays
    /// under the lease until its release. For a primary with replicas, a Sentinel-managed
    /// primary, or a Redis Cluster (each shard's primary waits for its own replicas; a set
    /// of keys waits once per slot). Default: off (0). Nothing checks `replicas` against
    /// the replicas the node has: more than it has refuses every lock.
    ///
    /// What it buys: a primary that fails right after granting a lock, before the write
    /// reached its replicas, no longer hands the lock to a second client once a replica is
    /// promoted, as long as the promoted replica is one that acknowledged. What it does
    /// not: replication stays asynchronous, and a failover may still promote a replica
    /// that had not acknowledged (Redis docs, `WAIT`: "it does not make Redis a strongly
    /// consistent store"); a primary restarted without persistence (and no failover)
    /// forgets, and its replicas with it. Acknowledged writes queue behind each other on
    /// their connection, each for the replicas' round trip (usually under a millisecond
    /// on a LAN). While the replicas are down, every acquisition and renewal on the node
    /// waits the replica timeout and is refused, so running leases end at their validity.
    ///
    /// The Redis docs: <https://redis.io/docs/latest/commands/wait/>. Applies to Redlock
    /// nodes; the limiters' stores (`RedisRateLimiter`, `RedisConcurrencyLimiter`) ignore
    /// it.
    ///
    /// [`replica_timeout`]: Node::replica_timeout
    /// [`NodeFailureReason::NotAcknowledged`]: crate::NodeFailureReason::NotAcknowledged
    pub fn wait_for_replicas(mut self, replicas: u32) -> Self {
        self.ack_mut().replicas = replicas;
        self
    }

    /// Also waits for the primary to fsync each such write to its append-only file
    /// (`WAITAOF 1 0 timeout`, Redis 7.2+, Valkey 8), so that a restart from the AOF keeps
    /// the lock. Needs `appendonly yes`, or every acquisition is refused. Default: off.
    /// The Redis docs: <https://redis.io/docs/latest/commands/waitaof/>.
    pub fn wait_for_fsync(mut self) -> Self {
        self.ack_mut().fsync = true;
        self
    }

    /// How long [`wait_for_replicas`] and [`wait_for_fsync`] wait in all (with both, half
    /// each). Default: half the node timeout, in whole milliseconds, at least 1 ms.
    ///
    /// Redis checks a blocked `WAIT`'s timeout at its periodic tick, every 100 ms with
    /// the default `hz 10`, so a refusal (too few acknowledgements) comes up to about
    /// 100 ms after the replica timeout, for each of `WAIT` and `WAITAOF`: measured, 180
    /// to 195 ms for a replica timeout of 100 ms. The replica timeout plus that margin
    /// (100 ms, or 200 ms with both) must be shorter than the node timeout, so that the
    /// node answers its refusal before it is given up on; else [`RedlockBuilder::build`]
    /// fails with [`ConfigError::InvalidReplicaTimeout`]. With the default, that takes
    /// a node timeout above 200 ms (above 400 ms with both).
    ///
    /// [`wait_for_replicas`]: Node::wait_for_replicas
    /// [`wait_for_fsync`]: Node::wait_for_fsync
    /// [`RedlockBuilder::build`]: crate::RedlockBuilder::build
    /// [`ConfigError::InvalidReplicaTimeout`]: crate::ConfigError::InvalidReplicaTimeout
    pub fn replica_timeout(mut self, timeout: Duration) -> Self {
        self.ack_mut().timeout = Some(timeout);
        self
    }

    fn ack_mut(&mut self) -> &mut ReplicaAck {
        self.ack.get_or_insert(ReplicaAck {
            replicas: 0,
            fsync: false,
            timeout: None,
        })
    }
}

/// The period of Redis' checks of blocked commands' timeouts with the default `hz 10`.
const REDIS_TICK: Duration = Duration::from_millis(100);

/// What a node's granting writes wait for ([`Node::wait_for_replicas`],
/// [`Node::wait_for_fsync`]): at least one of them is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaAck {
    pub(crate) replicas: u32,
    pub(crate) fsync: bool,
    /// `None` until the builder sets the default from the node timeout.
    pub(crate) timeout: Option<Duration>,
}

#[cfg_attr(not(feature = "lock"), allow(dead_code))]
impl ReplicaAck {
    /// Defaults the timeout to half of `node_timeout`, and checks that it is above zero
    /// and that it plus [`margin`](Self::margin) is shorter than `node_timeout`; else
    /// returns the timeout and the margin.
    pub(crate) fn resolve(&mut self, node_timeout: Duration) -> Result<(), (Duration, Duration)> {
        let timeout = *self
            .timeout
            .get_or_insert((node_timeout / 2).max(Duration::from_millis(1)));
        let margin = self.margin();
        if timeout.is_zero() || timeout.saturating_add(margin) >= node_timeout {
            return Err((timeout, margin));
        }
        Ok(())
    }

    /// How much later than the replica timeout a refusal may come: Redis notices a
    /// blocked command's timeout at its periodic tick (every 100 ms with `hz 10`), once
    /// for each of `WAIT` and `WAITAOF`.
    fn margin(&self) -> Duration {
        REDIS_TICK * self.commands()
    }

    /// How many waiting commands follow each write: `WAIT`, `WAITAOF`, or both.
    fn commands(&self) -> u32 {
        u32::from(self.replicas > 0) + u32::from(self.fsync)
    }

    /// `cmd`, then `WAIT` (and `WAITAOF`), as one pipeline.
    pub(crate) fn pipeline(&self, cmd: &Cmd) -> Pipeline {
        let total = self
            .timeout
            .map_or(1, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        // The commands wait one after the other: each gets its share of the timeout.
        let commands = u64::from(self.commands());
        let ms = (total / commands.max(1)).max(1);
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone());
        if self.replicas > 0 {
            pipe.cmd("WAIT").arg(self.replicas).arg(ms);
        }
        if self.fsync {
            pipe.cmd("WAITAOF").arg(1).arg(0).arg(ms);
        }
        pipe
    }

    /// How many replies [`ReplicaAck::pipeline`] gets back.
    pub(crate) fn replies(&self) -> usize {
        1 + usize::from(self.replicas > 0) + usize::from(self.fsync)
    }

    /// Reads the `WAIT` and `WAITAOF` replies: `None` when every acknowledgement came.
    pub(crate) fn acknowledged(
        &self,
        replies: &[Value],
    ) -> RedisResult<Option<crate::error::NodeFailureReason>> {
        let mut replies = replies.iter();
        let mut replicas = None;
        if self.replicas > 0 {
            let n: u64 = redis::from_redis_value_ref(replies.next().unwrap_or(&Value::Nil))?;
            replicas = Some(n);
        }
        let mut fsynced = true;
        if self.fsync {
            let (local, _): (u64, u64) =
                redis::from_redis_value_ref(replies.next().unwrap_or(&Value::Nil))?;
            fsynced = local >= 1;
        }
        let enough = replicas.is_none_or(|n| n >= u64::from(self.replicas));
        if enough && fsynced {
            return Ok(None);
        }
        Ok(Some(crate::error::NodeFailureReason::NotAcknowledged {
            replicas: replicas.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            wanted: self.replicas,
            fsynced,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(replicas: u32, fsync: bool, ms: u64) -> ReplicaAck {
        ReplicaAck {
            replicas,
            fsync,
            timeout: Some(Duration::from_millis(ms)),
        }
    }

    #[test]
    fn the_waits_share_the_replica_timeout() {
        let packed = |a: ReplicaAck| {
            String::from_utf8_lossy(&a.pipeline(&redis::cmd("PING")).get_packed_pipeline())
                .into_owned()
        };
        assert!(packed(ack(1, false, 100)).contains("WAIT\r\n$1\r\n1\r\n$3\r\n100\r\n"));
        let both = packed(ack(2, true, 100));
        assert!(both.contains("WAIT\r\n$1\r\n2\r\n$2\r\n50\r\n"), "{both}");
        assert!(
            both.contains("WAITAOF\r\n$1\r\n1\r\n$1\r\n0\r\n$2\r\n50\r\n"),
            "{both}"
        );
        assert_eq!(ack(2, true, 100).replies(), 3);
    }

    #[test]
    fn the_default_is_half_the_node_timeout_and_must_be_shorter() {
        let mut a = ReplicaAck {
            timeout: None,
            ..ack(1, false, 0)
        };
        assert_eq!(a.resolve(Duration::from_millis(500)), Ok(()));
        assert_eq!(a.timeout, Some(Duration::from_millis(250)));
        let mut long = ack(1, false, 500);
        let ms = Duration::from_millis;
        assert_eq!(long.resolve(ms(500)), Err((ms(500), ms(100))));
    }

    #[test]
    fn the_replica_timeout_leaves_redis_tick_per_wait_in_the_node_timeout() {
        let ms = Duration::from_millis;
        // 100 ms beyond the replica timeout for WAIT: 399 + 100 fits in 500, 400 does not.
        assert_eq!(ack(1, false, 399).resolve(ms(500)), Ok(()));
        assert_eq!(ack(1, false, 400).resolve(ms(500)), Err((ms(400), ms(100))));
        // 100 ms for each of WAIT and WAITAOF.
        assert_eq!(ack(1, true, 299).resolve(ms(500)), Ok(()));
        assert_eq!(ack(1, true, 300).resolve(ms(500)), Err((ms(300), ms(200))));
        // The default, half the node timeout, fits only above 200 ms.
        let mut default = ReplicaAck {
            timeout: None,
            ..ack(1, false, 0)
        };
        assert_eq!(default.resolve(ms(200)), Err((ms(100), ms(100))));
    }

    #[test]
    fn acknowledgements_fall_short_with_too_few_replicas_or_no_fsync() {
        let two = ack(2, false, 100);
        assert!(two.acknowledged(&[Value::Int(2)]).unwrap().is_none());
        assert!(matches!(
            two.acknowledged(&[Value::Int(1)]).unwrap(),
            Some(crate::error::NodeFailureReason::NotAcknowledged {
                replicas: 1,
                wanted: 2,
                fsynced: true
            })
        ));
        let fsync = ack(0, true, 100);
        let aof = |local| Value::Array(vec![Value::Int(local), Value::Int(0)]);
        assert!(fsync.acknowledged(&[aof(1)]).unwrap().is_none());
        assert!(matches!(
            fsync.acknowledged(&[aof(0)]).unwrap(),
            Some(crate::error::NodeFailureReason::NotAcknowledged { fsynced: false, .. })
        ));
    }
}
