//! Test harness: real `redis-server` processes on free loopback ports, and real HTTP.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One `redis-server` process, stopped on drop.
pub struct RedisNode {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free loopback port")
        .local_addr()
        .unwrap()
        .port()
}

impl RedisNode {
    /// Starts a node on a free port, without persistence, and waits until it answers PING.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed (with how to install it) or does not start
    /// within 10 s.
    pub fn start() -> Self {
        for _ in 0..5 {
            let mut node = RedisNode {
                port: free_port(),
                dir: tempfile::tempdir().expect("temporary directory"),
                child: None,
            };
            if node.spawn() {
                return node;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed: the tests start their own Redis nodes. \
                 Install it (Debian/Ubuntu: `apt-get install redis-server`; macOS: `brew install redis`), \
                 or run scripts/test, which installs it."
            ),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.answers_ping() {
                return true;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                // Most likely the port was taken meanwhile.
                let _ = status;
                self.child = None;
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        false
    }

    fn answers_ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200))
        else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        if stream.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut buf = [0u8; 7];
        stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// The process id, while the node runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the process (SIGKILL) and waits for it: the node and everything it held are gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the node again on the same port, empty.
    pub fn restart(&mut self) {
        if self.child.is_some() {
            self.resume_if_paused();
        }
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not restart on port {}", self.port);
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("node is running").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    fn resume_if_paused(&self) {
        if let Some(child) = self.child.as_ref() {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
    }

    /// Freezes the process (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused process (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// A direct connection, to look at what the node stores.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("connect to test node")
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_ref() {
            // A paused process must be thawed to die cleanly.
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.kill();
    }
}

/// Whether the node's process is running and answers PING.
pub fn answers(node: &RedisNode) -> bool {
    node.child.is_some() && node.answers_ping()
}

/// Starts `n` independent nodes.
pub fn nodes(n: usize) -> Vec<RedisNode> {
    (0..n).map(|_| RedisNode::start()).collect()
}

pub fn urls(nodes: &[RedisNode]) -> Vec<String> {
    nodes.iter().map(RedisNode::url).collect()
}

/// Serves `app` on a free loopback port; returns its base URL. The server lives until the
/// test's runtime ends.
pub async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    format!("http://{addr}")
}

/// Whether `key` exists on the node.
pub async fn exists(node: &RedisNode, key: &str) -> bool {
    let mut conn = node.conn().await;
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap()
        == 1
}

/// Polls `check` every 10 ms until it holds or `within` passes; returns whether it held.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Subscribers on `channel`, summed over the nodes (`PUBSUB NUMSUB`).
pub async fn subscribers(nodes: &[RedisNode], channel: &str) -> i64 {
    let mut total = 0;
    for node in nodes {
        let mut conn = node.conn().await;
        let counts: Vec<(String, i64)> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut conn)
            .await
            .unwrap();
        total += counts.iter().map(|(_, n)| n).sum::<i64>();
    }
    total
}
