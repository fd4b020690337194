//! Test harness: real `redis-server` processes on free loopback ports, and real HTTP.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Clusters, Sentinel, TLS and other server binaries.
pub mod topology;

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

    /// Thaws the process if it is paused (SIGCONT); nothing otherwise.
    pub fn resume_if_paused(&self) {
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

/// A `Redlock` over `nodes` with lease TTL `ttl` and a 200 ms node timeout, as `Locks`.
pub async fn redlock(nodes: &[RedisNode], ttl: Duration) -> tower_redlock::Locks {
    let redlock = tower_redlock::Redlock::builder(urls(nodes))
        .ttl(ttl)
        .node_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    tower_redlock::Locks::from(redlock)
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

/// The keys on the node at `url` that match `pattern` (`SCAN ... MATCH`), in no order.
pub async fn scan(url: &str, pattern: &str) -> Vec<String> {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
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

/// What a [`FakeServer`] answers to every read.
pub const HTTP_400: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
/// A RESP error, as a proxy without a backend might answer every command.
pub const RESP_ERROR: &[u8] = b"-ERR no backend available\r\n";

/// A TCP server on a given port that is not Redis: it answers every read with fixed bytes
/// (such as an HTTP 400), or every command with [`RESP_ERROR`], and keeps the connection
/// open, as a web server with keep-alive does. Stopped (listener and connections closed)
/// by [`FakeServer::stop`] or on drop.
pub struct FakeServer {
    port: u16,
    answered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl FakeServer {
    /// Listens on `port` (retrying for up to 5 s while it is still taken) and answers every
    /// read with `reply`.
    pub fn start(port: u16, reply: &'static [u8]) -> Self {
        Self::listen(port, reply, false)
    }

    /// Listens on `port` and answers every command (each RESP array in a read) with
    /// [`RESP_ERROR`].
    pub fn start_resp_errors(port: u16) -> Self {
        Self::listen(port, RESP_ERROR, true)
    }

    fn listen(port: u16, reply: &'static [u8], per_command: bool) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", port)) {
                Ok(listener) => break listener,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("fake server cannot bind port {port}: {e}"),
            }
        };
        listener.set_nonblocking(true).unwrap();
        let answered = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Arc<Mutex<Vec<std::thread::JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (answered, stop, workers) = (answered.clone(), stop.clone(), workers.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            let (answered, stop) = (answered.clone(), stop.clone());
                            let worker = std::thread::spawn(move || {
                                stream.set_nonblocking(false).unwrap();
                                stream
                                    .set_read_timeout(Some(Duration::from_millis(10)))
                                    .unwrap();
                                let mut buf = [0u8; 4096];
                                while !stop.load(Ordering::Acquire) {
                                    match stream.read(&mut buf) {
                                        Ok(0) => return,
                                        Ok(n) => {
                                            let commands = if per_command {
                                                // Array headers at the start of a line.
                                                let read = &buf[..n];
                                                usize::from(read.first() == Some(&b'*'))
                                                    + read
                                                        .windows(3)
                                                        .filter(|w| w == b"\r\n*")
                                                        .count()
                                            } else {
                                                1
                                            };
                                            if stream.write_all(&reply.repeat(commands)).is_err() {
                                                return;
                                            }
                                            answered.fetch_add(1, Ordering::AcqRel);
                                        }
                                        Err(e)
                                            if matches!(
                                                e.kind(),
                                                std::io::ErrorKind::WouldBlock
                                                    | std::io::ErrorKind::TimedOut
                                            ) => {}
                                        Err(_) => return,
                                    }
                                }
                            });
                            workers.lock().unwrap().push(worker);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
                // The listener closes here; then every connection.
                drop(listener);
                for worker in std::mem::take(&mut *workers.lock().unwrap()) {
                    let _ = worker.join();
                }
            })
        };
        FakeServer {
            port,
            answered,
            stop,
            threads: vec![accept],
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// How many reads it has answered, over all connections.
    pub fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Closes the listener and every connection, and waits until they are closed.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A TCP proxy on a free loopback port in front of a node. [`Proxy::black_hole`] makes
/// the connections open at that moment stop forwarding in both directions while staying
/// open, as a path whose peer vanished without a reset (a replaced pod behind a stale
/// NAT entry, a dropped route): nothing answers, nothing fails. New connections are
/// forwarded as before. Stops with the test's runtime or on drop.
pub struct Proxy {
    port: u16,
    epoch: std::sync::Arc<std::sync::atomic::AtomicU64>,
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    tasks: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let epoch = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let tasks: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let accept = {
            let (epoch, open, tasks) = (epoch.clone(), open.clone(), tasks.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                        continue;
                    };
                    let born = epoch.load(Ordering::Acquire);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    open.fetch_add(1, Ordering::AcqRel);
                    let up = tokio::spawn(forward(client_read, server_write, epoch.clone(), born));
                    let down =
                        tokio::spawn(forward(server_read, client_write, epoch.clone(), born));
                    let open = open.clone();
                    let (up_handle, down_handle) = (up.abort_handle(), down.abort_handle());
                    let watcher = tokio::spawn(async move {
                        // Closed when the client side closes (or the server's does).
                        let _ = up.await;
                        open.fetch_sub(1, Ordering::AcqRel);
                        down.abort();
                    });
                    tasks
                        .lock()
                        .unwrap()
                        .extend([watcher.abort_handle(), up_handle, down_handle]);
                }
            })
        };
        tasks.lock().unwrap().push(accept.abort_handle());
        Proxy {
            port,
            epoch,
            open,
            tasks,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// From now on, connections opened before this call forward nothing (and stay open).
    pub fn black_hole(&self) {
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Client connections open through the proxy.
    pub fn open_connections(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Copies `from` to `to` while the connection's epoch is current; afterwards reads and
/// drops, so that the connection stays open but silent. Ends when `from` closes.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    epoch: std::sync::Arc<std::sync::atomic::AtomicU64>,
    born: u64,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if epoch.load(std::sync::atomic::Ordering::Acquire) == born
            && to.write_all(&buf[..n]).await.is_err()
        {
            return;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// Every command's calls on the node so far (`INFO commandstats`), `info` itself left out.
pub async fn command_calls(node: &RedisNode) -> std::collections::BTreeMap<String, u64> {
    let mut conn = node.conn().await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(":calls=")?;
            let calls = rest.split(',').next()?.parse().ok()?;
            (name != "info").then(|| (name.to_owned(), calls))
        })
        .collect()
}

/// Calls of `command` (lower case, as `INFO commandstats` names it) on the node so far.
pub async fn calls(node: &RedisNode, command: &str) -> u64 {
    command_calls(node).await.get(command).copied().unwrap_or(0)
}

/// The string value of `key` on the node, if any.
pub async fn get(node: &RedisNode, key: &str) -> Option<String> {
    let mut conn = node.conn().await;
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// The `PTTL` of `key` on the node, in ms (-2 without the key, -1 without an expiry).
pub async fn pttl(node: &RedisNode, key: &str) -> i64 {
    let mut conn = node.conn().await;
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// An empty `POST` to `url`, answered.
pub async fn post_to(client: &reqwest::Client, url: impl reqwest::IntoUrl) -> reqwest::Response {
    client.post(url).send().await.unwrap()
}

/// The response's `Retry-After`, in whole seconds (it must be one).
pub fn retry_after(resp: &reqwest::Response) -> u64 {
    resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// What the crate logs, captured for one test: the subscriber is the default of the
/// test's thread (its current-thread runtime runs there), at the default `INFO` level.
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

impl Logs {
    /// Starts capturing; until the guard is dropped.
    pub fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish();
        (logs.clone(), tracing::subscriber::set_default(subscriber))
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// The lines that contain every one of `needles`.
    pub fn lines_with(&self, needles: &[&str]) -> usize {
        self.text()
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .count()
    }

    /// The `ERROR` lines that contain `needle`.
    pub fn errors_with(&self, needle: &str) -> usize {
        self.lines_with(&["ERROR", needle])
    }
}

/// The node's client connections (`CLIENT LIST`), one line each.
pub async fn client_list(node: &RedisNode) -> Vec<String> {
    let mut conn = node.conn().await;
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .unwrap();
    // Leave out the connection that asks.
    list.lines()
        .filter(|line| !line.contains("cmd=client|list"))
        .map(str::to_owned)
        .collect()
}

/// The commands a node runs, scripts' own included, as `MONITOR` shows them (one line
/// each, arguments quoted), read on a thread of its own until dropped.
pub struct Monitor {
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stream: TcpStream,
}

impl Monitor {
    /// Starts watching `node`; returns once the node confirmed (`+OK`).
    pub fn start(node: &RedisNode) -> Self {
        use std::io::BufRead;
        let mut stream = TcpStream::connect(node.addr()).expect("connect for MONITOR");
        stream.write_all(b"MONITOR\r\n").unwrap();
        let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
        let mut ok = String::new();
        reader.read_line(&mut ok).unwrap();
        assert_eq!(ok.trim(), "+OK", "MONITOR refused");
        let lines: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
        let seen = lines.clone();
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { return };
                seen.lock().unwrap().push(line);
            }
        });
        Monitor { lines, stream }
    }

    /// Whether a command that contains every one of `needles` was seen.
    pub fn seen(&self, needles: &[&str]) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|line| needles.iter().all(|n| line.contains(n)))
    }

    /// Every line seen so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
