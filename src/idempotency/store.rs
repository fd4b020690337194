//! Where records live: beside the lock, on the same backend.
//!
//! - In process: the bounded records kept by [`MemoryLocks`](crate::MemoryLocks) beside
//!   its locks.
//! - Redis: each record is a string `{<lock key>}:record` on every Redlock node, in the
//!   lock key's Redis Cluster slot. A first request checks for a record and acquires the
//!   lock in one script per node; it stores its record and releases the lock in one
//!   script per node, acknowledged by a quorum. A retry reads a quorum and takes the
//!   record if any node that answered has it: every read quorum meets every write quorum.

pub(crate) use crate::backend::records::Begin;
