//! A TCP proxy that delays each direction by a fixed time, in front of a Redis node, so
//! that a round trip costs what it would across a network: every chunk read from one side
//! is written to the other `delay` after it arrived, in order. Chunks that arrive while
//! earlier ones wait are read at once and wait their own `delay` (a latency, not a rate
//! limit). The kernel here has no netem, hence a proxy.
//!
//! Tokio's timers fire on whole milliseconds (a 2 ms sleep ends 2 to 3 ms later, and a hop
//! that starts just after a tick costs 3), too coarse for a 2 ms hop: the waits are timed
//! by one thread of their own ([`Timer`]), which sleeps to the next deadline with the OS's
//! precision (tens of µs) and wakes the task whose chunk is due.
#![allow(dead_code, unreachable_pub)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;

/// A deadline to wake, ordered by time, then by arrival.
struct Due {
    at: Instant,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// Sleeps with the OS timer's precision: one thread holds the deadlines and wakes each
/// waiting task when its time comes. The thread ends when every handle is dropped and no
/// deadline is left.
#[derive(Clone)]
pub struct Timer {
    deadlines: mpsc::Sender<(Instant, oneshot::Sender<()>)>,
}

impl Timer {
    pub fn start() -> Self {
        let (tx, rx) = mpsc::channel::<(Instant, oneshot::Sender<()>)>();
        std::thread::Builder::new()
            .name("delay-timer".to_owned())
            .spawn(move || {
                let mut heap = BinaryHeap::new();
                let mut seq = 0u64;
                let mut open = true;
                loop {
                    let now = Instant::now();
                    while heap
                        .peek()
                        .is_some_and(|Reverse(due): &Reverse<Due>| due.at <= now)
                    {
                        if let Some(Reverse(due)) = heap.pop() {
                            let _ = due.wake.send(());
                        }
                    }
                    let next = heap.peek().map(|Reverse(due)| due.at - now);
                    let received = match (next, open) {
                        (None, false) => return,
                        (Some(wait), false) => {
                            std::thread::sleep(wait);
                            continue;
                        }
                        (None, true) => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                        (Some(wait), true) => rx.recv_timeout(wait),
                    };
                    match received {
                        Ok((at, wake)) => {
                            seq += 1;
                            heap.push(Reverse(Due { at, seq, wake }));
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => open = false,
                    }
                }
            })
            .expect("start the delay timer's thread");
        Timer { deadlines: tx }
    }

    /// Returns at `at`, to within the OS's timer slack.
    pub async fn sleep_until(&self, at: Instant) {
        if Instant::now() >= at {
            return;
        }
        let (wake, woken) = oneshot::channel();
        if self.deadlines.send((at, wake)).is_ok() {
            let _ = woken.await;
        }
    }
}

/// A proxy on a free loopback port that forwards to `target` with `delay` each way. It
/// runs on the runtime it was started on, until that runtime ends.
pub struct DelayProxy {
    addr: SocketAddr,
}

impl DelayProxy {
    pub async fn start(target: SocketAddr, delay: Duration, timer: Timer) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                forward(client_read, server_write, delay, timer.clone());
                forward(server_read, client_write, delay, timer.clone());
            }
        });
        DelayProxy { addr }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }
}

/// One direction: a task reads chunks as they come and stamps them, another writes each
/// one `delay` after its stamp, in order. Ends (shutting the write side) when `from` closes.
fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration, timer: Timer) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Bytes)>();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let due = Instant::now() + delay;
            if tx.send((due, Bytes::copy_from_slice(&buf[..n]))).is_err() {
                return;
            }
        }
    });
    tokio::spawn(async move {
        while let Some((due, chunk)) = rx.recv().await {
            timer.sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
}
