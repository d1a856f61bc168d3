//! Fault injection and invariant checks for the write-path tests (tests/faults.rs, tests/model.rs).
//!
//! - [`StallProxy`]: a TCP forwarder between the provider and the apiserver that can stall traffic
//!   (connections stay open, no bytes move), add latency, and hold the requests of one connection
//!   or of the connections open now until the test lets them go, even after the client has closed
//!   them (a late delivery). TLS passes through untouched (only the plaintext record headers are
//!   read, to tell requests from silence), so tests time faults by watching the API directly.
//! - [`ApiServer`]: the test control plane's kube-apiserver process: SIGKILL and restart on the same
//!   port and etcd, SIGSTOP / SIGCONT.
//! - [`GroupView`] and [`History`]: what invariants 2 and 3 (docs/architecture.md) are checked on — a group's
//!   replicas and bounds with its Machines and their delete marks, read from the API; and every
//!   version of the groups of a namespace, from a watch that resumes across apiserver restarts.
//! - [`provider_metric`]: one series of the provider's /metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{DynamicObject, ListParams};
use kube::{Api, Client};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::capi::{Capi, Kind};
use super::procs::{self, Check, poll_until};
use super::resuming_watch::{Watched, watch_resuming};
use super::{ControlPlane, client_from_kubeconfig};

/// The suffix of the delete marks the provider writes (`unix <seconds> by capi-autoscaler-provider`).
/// Spelled out here rather than taken from the crate, so the tests check the provider, not
/// themselves.
pub const OUR_MARK_SUFFIX: &str = " by capi-autoscaler-provider";
/// The MachinePool annotation listing the removals its replicas pay for.
pub const LEDGER_ANNOTATION: &str = "capi-autoscaler-provider/removed";
/// The group annotation naming the removals under way (claimed before their marks).
pub const CLAIMS_ANNOTATION: &str = "capi-autoscaler-provider/claims";

/// Seconds since the epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// When a mark of ours was written, from its value.
pub fn our_mark_time(value: &str) -> Option<u64> {
    value
        .strip_suffix(OUR_MARK_SUFFIX)?
        .strip_prefix("unix ")?
        .trim()
        .parse()
        .ok()
}

// ---------------------------------------------------------------------------------------------------
// The stalling proxy.

/// Which connections a direction holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    Open,
    Closed,
    /// Client→server only: held on connections flagged [`Connection::hold_requests`].
    Flagged,
    /// Client→server only: held on the connections opened before the one with this id.
    OpenedBefore(u64),
}

impl Gate {
    fn holds(self, connection: &Connection) -> bool {
        match self {
            Gate::Open => false,
            Gate::Closed => true,
            Gate::Flagged => connection.hold_requests.load(Ordering::SeqCst),
            Gate::OpenedBefore(id) => connection.id < id,
        }
    }
}

/// What the two pumps of one connection share.
struct Connection {
    id: u64,
    /// The proxy's epoch when the client last sent an application-data record (0: never).
    request_epoch: AtomicU64,
    /// Its requests are held (a [`Hold`] holds this connection).
    hold_requests: AtomicBool,
}

/// A hold of one connection's requests, armed or in effect.
#[derive(Clone)]
enum Hold {
    Off,
    /// The answer to a request sent in this epoch or later, on a connection older than the second
    /// number, passes; then, after as many more answers as the third number says (each to a
    /// request sent after the previous answer), [`Hold::NextRequest`].
    AfterAnswer(u64, u64, u32),
    /// The connection that sends the next request is held (requests only).
    NextRequest,
    /// This connection's requests are held until [`StallProxy::resume`].
    Holding(Arc<Connection>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    /// Client (the provider) to server (the apiserver): requests.
    Up,
    /// Server to client: answers and watch events.
    Down,
}

struct ProxyShared {
    up: watch::Sender<Gate>,
    down: watch::Sender<Gate>,
    hold: Mutex<Hold>,
    /// Bumped whenever "requests sent from now on" starts.
    epoch: AtomicU64,
    next_connection: AtomicU64,
    /// Request bytes read from the provider and not passed on yet.
    held_up: AtomicUsize,
    delay_up_ms: AtomicU64,
    linger: Duration,
}

impl ProxyShared {
    fn gate(&self, dir: Dir) -> &watch::Sender<Gate> {
        match dir {
            Dir::Up => &self.up,
            Dir::Down => &self.down,
        }
    }
    fn new_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// A TCP forwarder to `target` whose traffic a test can stall, hold and delay.
///
/// Bytes are read from one side as they come and written to the other in chunks; a held chunk
/// waits until its direction opens for its connection (it is neither dropped nor reordered within
/// the connection), and a delayed one until its delay has passed since it was read.
/// When a client closes its side, the proxy still delivers what it read, and passes the close on
/// (its TLS close_notify, then its FIN) only after a `linger`: a request the provider gave up on
/// reaches the apiserver late and is processed normally, as through a load balancer that buffers.
/// The proxy reads the plaintext TLS record headers only: a request is an application-data record
/// from the client (in TLS 1.3 the client's handshake Finished is one too, which only makes the
/// connection it opens count as having sent a request a little early).
pub struct StallProxy {
    pub addr: SocketAddr,
    shared: Arc<ProxyShared>,
    task: JoinHandle<()>,
}

impl StallProxy {
    /// Listens on 127.0.0.1 (any free port) and forwards to `target`; everything flows.
    pub async fn start(target: SocketAddr) -> StallProxy {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind the stalling proxy on 127.0.0.1");
        let addr = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(ProxyShared {
            up: watch::Sender::new(Gate::Open),
            down: watch::Sender::new(Gate::Open),
            hold: Mutex::new(Hold::Off),
            epoch: AtomicU64::new(1),
            next_connection: AtomicU64::new(0),
            held_up: AtomicUsize::new(0),
            delay_up_ms: AtomicU64::new(0),
            linger: Duration::from_secs(2),
        });
        let task = tokio::spawn({
            let shared = Arc::clone(&shared);
            async move {
                let mut connections = tokio::task::JoinSet::new();
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    let connection = Arc::new(Connection {
                        id: shared.next_connection.fetch_add(1, Ordering::SeqCst),
                        request_epoch: AtomicU64::new(0),
                        hold_requests: AtomicBool::new(false),
                    });
                    let shared = Arc::clone(&shared);
                    connections.spawn(async move {
                        let Ok(outbound) = TcpStream::connect(target).await else {
                            return;
                        };
                        let _ = inbound.set_nodelay(true);
                        let _ = outbound.set_nodelay(true);
                        let (in_read, in_write) = inbound.into_split();
                        let (out_read, out_write) = outbound.into_split();
                        tokio::join!(
                            pump(
                                Arc::clone(&connection),
                                Dir::Up,
                                in_read,
                                out_write,
                                Arc::clone(&shared)
                            ),
                            pump(connection, Dir::Down, out_read, in_write, shared),
                        );
                    });
                    while connections.try_join_next().is_some() {}
                }
            }
        });
        StallProxy { addr, shared, task }
    }

    /// `https://127.0.0.1:<port>`, for a kubeconfig.
    pub fn server(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Both directions held for every connection, new ones included: connections stay open, no
    /// byte moves (a new connection does not get through its TLS handshake).
    pub fn stall(&self) {
        self.shared.up.send_replace(Gate::Closed);
        self.shared.down.send_replace(Gate::Closed);
    }

    /// Everything flows again (held bytes first, in order within each connection).
    pub fn resume(&self) {
        let mut hold = lock(&self.shared.hold);
        if let Hold::Holding(held) = &*hold {
            held.hold_requests.store(false, Ordering::SeqCst);
        }
        *hold = Hold::Off;
        self.shared.up.send_replace(Gate::Open);
        self.shared.down.send_replace(Gate::Open);
    }

    /// The connection that carries the request the provider sends after `answers` answers, each
    /// to a request sent after the previous one (IncreaseSize: its read of the group and its
    /// Cluster answered, then its write), has that request and every later one held (answers and
    /// watch events on it still pass) until [`resume`](Self::resume). When the provider gives the
    /// connection up, what it sent is still delivered on resume: a request it gave up on reaches
    /// the apiserver after everything it did since, as through a load balancer that forwards a
    /// request whose client has gone. Only answers on connections
    /// that exist now count: on a connection opened later, the first bytes after the TLS handshake
    /// are session tickets and settings, not an answer. A count of answers suits a call whose
    /// reads do not depend on the cache (a removal's do: see
    /// [`hold_open_connections`](Self::hold_open_connections)).
    pub fn hold_after_answers(&self, answers: u32) {
        let epoch = self.shared.new_epoch();
        let existing = self.shared.next_connection.load(Ordering::SeqCst);
        *lock(&self.shared.hold) = Hold::AfterAnswer(epoch, existing, answers.max(1));
    }

    /// Requests on the connections open now are held from now on, those already read and still
    /// delayed by [`delay_requests`](Self::delay_requests) included, until
    /// [`resume`](Self::resume); connections opened later flow. Armed when the test sees in the
    /// API that a write landed, under a delay longer than the test takes to see it, this holds
    /// the requests the provider sends on learning of that write (after a claim: the mark; after
    /// a mark: its read, and so the decrement) whatever requests came before it: no count of
    /// answers, which depends on how the provider reads.
    pub fn hold_open_connections(&self) {
        let next = self.shared.next_connection.load(Ordering::SeqCst);
        *lock(&self.shared.hold) = Hold::Off;
        self.shared.up.send_replace(Gate::OpenedBefore(next));
    }

    /// Whether the provider's requests are held now (some of their bytes wait in the proxy).
    pub fn holding(&self) -> bool {
        self.held_request_bytes() > 0
    }

    /// Every client→server chunk is passed on `delay` after it was read (its latency, not a
    /// limit on throughput).
    pub fn delay_requests(&self, delay: Duration) {
        self.shared
            .delay_up_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Request bytes read from the provider and not passed on yet.
    pub fn held_request_bytes(&self) -> usize {
        self.shared.held_up.load(Ordering::SeqCst)
    }

    /// Waits (at most `timeout`) until some request bytes are held: the provider sent a request.
    pub async fn wait_held_request(&self, timeout: Duration) -> Result<(), String> {
        poll_until(
            "a request held by the proxy",
            timeout,
            Duration::from_millis(5),
            || async {
                match self.held_request_bytes() {
                    0 => Check::Wait("no request bytes held".into()),
                    _ => Check::Done(()),
                }
            },
        )
        .await
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Follows TLS record boundaries in one direction of a connection (the record header — type,
/// version, length — is plaintext).
#[derive(Default)]
struct Records {
    header: [u8; 5],
    have: usize,
    remaining: usize,
}

/// What a chunk of one direction carries, as far as record headers tell.
#[derive(Default)]
struct Seen {
    /// An application-data record (type 23) starts in it that is not an alert: a request (or, in
    /// TLS 1.3, the client's handshake Finished).
    application_data: bool,
    /// An alert starts in it: a TLS 1.2 alert record (type 21), or a TLS 1.3 encrypted one (type 23
    /// with 19 bytes: a 2-byte alert, the inner type, a 16-byte AEAD tag). A client's alert after
    /// the handshake is its close_notify: it is going away.
    alert: bool,
}

/// The length of a TLS 1.3 record that carries only an alert (2 + 1 + 16).
const ENCRYPTED_ALERT_LEN: usize = 19;

impl Records {
    /// Consumes `data`.
    fn scan(&mut self, data: &[u8]) -> Seen {
        let mut seen = Seen::default();
        let mut i = 0;
        while i < data.len() {
            if self.remaining > 0 {
                let take = self.remaining.min(data.len() - i);
                self.remaining -= take;
                i += take;
                continue;
            }
            self.header[self.have] = data[i];
            self.have += 1;
            i += 1;
            if self.have == self.header.len() {
                self.remaining = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                let alert = self.header[0] == 21
                    || (self.header[0] == 23 && self.remaining == ENCRYPTED_ALERT_LEN);
                seen.alert |= alert;
                seen.application_data |= self.header[0] == 23 && !alert;
                self.have = 0;
            }
        }
        seen
    }
}

/// What the reader of one direction hands its writer.
enum Piece {
    Chunk {
        bytes: Vec<u8>,
        read_at: tokio::time::Instant,
        /// The client's close_notify (TLS alert): passed on after the linger, like its FIN.
        goodbye: bool,
    },
    Closed,
}

/// One direction of a connection: a reader that takes every byte off the socket as it comes (so
/// that what the source sent before it closed or reset the connection is kept, as a buffering
/// load balancer keeps it) and a writer that passes each chunk on once its delay has passed and
/// its direction's gate is open, in order.
async fn pump(
    connection: Arc<Connection>,
    dir: Dir,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: Arc<ProxyShared>,
) {
    let (pieces, mut queue) = tokio::sync::mpsc::unbounded_channel();
    let debug = tracing_enabled();
    let reader = {
        let (connection, shared) = (Arc::clone(&connection), Arc::clone(&shared));
        async move {
            let mut records = Records::default();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match from.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if debug {
                    trace(format_args!(
                        "conn {} {dir:?}: {n} bytes, gate {:?}",
                        connection.id,
                        *shared.gate(dir).borrow()
                    ));
                }
                let mut goodbye = false;
                match dir {
                    Dir::Up => {
                        let seen = records.scan(&buf[..n]);
                        if seen.application_data {
                            on_request(&shared, &connection);
                        }
                        goodbye = seen.alert;
                        shared.held_up.fetch_add(n, Ordering::SeqCst);
                    }
                    Dir::Down => on_answer(&shared, &connection),
                }
                let piece = Piece::Chunk {
                    bytes: buf[..n].to_vec(),
                    read_at: tokio::time::Instant::now(),
                    goodbye,
                };
                if pieces.send(piece).is_err() {
                    return;
                }
            }
            if debug {
                trace(format_args!(
                    "conn {} {dir:?}: closed by its source",
                    connection.id
                ));
            }
            let _ = pieces.send(Piece::Closed);
        }
    };
    let writer = async move {
        let mut gate = shared.gate(dir).subscribe();
        let open = |g: &Gate| !g.holds(&connection);
        while let Some(piece) = queue.recv().await {
            match piece {
                Piece::Chunk {
                    bytes,
                    read_at,
                    goodbye,
                } => {
                    // A request is delayed before the gate: one still on its way when a hold
                    // starts is held.
                    if dir == Dir::Up {
                        let delay = shared.delay_up_ms.load(Ordering::SeqCst);
                        tokio::time::sleep_until(read_at + Duration::from_millis(delay)).await;
                    }
                    let waited = gate.wait_for(open).await.map(drop);
                    if goodbye {
                        // The client's close_notify waits like its disconnect (see below).
                        tokio::time::sleep(shared.linger).await;
                    }
                    if dir == Dir::Up {
                        shared.held_up.fetch_sub(bytes.len(), Ordering::SeqCst);
                    }
                    if waited.is_err() || to.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
                Piece::Closed => {
                    // The source closed: pass the close on once this direction flows, after a
                    // linger upstream so a late request is processed rather than cancelled by
                    // the client's disconnect.
                    if gate.wait_for(open).await.is_err() {
                        return;
                    }
                    if dir == Dir::Up {
                        tokio::time::sleep(shared.linger).await;
                    }
                    let _ = to.shutdown().await;
                    return;
                }
            }
        }
    };
    tokio::join!(reader, writer);
}

/// `STALL_PROXY_DEBUG=1` traces every chunk, hold and release to stderr (to debug a fault test).
fn tracing_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("STALL_PROXY_DEBUG").is_some())
}

fn trace(what: std::fmt::Arguments<'_>) {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    eprintln!(
        "proxy {}.{:03}: {what}",
        since.as_secs(),
        since.subsec_millis()
    );
}

/// The client of `connection` sent a request (before it is passed on: its answer cannot come back
/// before this ran).
fn on_request(shared: &ProxyShared, connection: &Arc<Connection>) {
    let mut hold = lock(&shared.hold);
    connection
        .request_epoch
        .store(shared.epoch.load(Ordering::SeqCst), Ordering::SeqCst);
    if matches!(*hold, Hold::NextRequest) {
        if tracing_enabled() {
            trace(format_args!(
                "conn {}: its requests are held",
                connection.id
            ));
        }
        connection.hold_requests.store(true, Ordering::SeqCst);
        *hold = Hold::Holding(Arc::clone(connection));
        shared.up.send_replace(Gate::Flagged);
    }
}

/// Server→client bytes arrived on `connection`: arm the hold [`Hold::AfterAnswer`] waits for.
fn on_answer(shared: &ProxyShared, connection: &Connection) {
    let mut hold = lock(&shared.hold);
    let request_epoch = connection.request_epoch.load(Ordering::SeqCst);
    if let Hold::AfterAnswer(epoch, existing, left) = &*hold
        && request_epoch >= *epoch
        && connection.id < *existing
    {
        *hold = if *left > 1 {
            // The next answer counts only once a request was sent after this one.
            Hold::AfterAnswer(shared.new_epoch(), *existing, left - 1)
        } else {
            Hold::NextRequest
        };
    }
}

// ---------------------------------------------------------------------------------------------------
// The control plane's kube-apiserver process.

/// The kube-apiserver of this test binary's control plane, found by its command line.
pub struct ApiServer {
    pub pid: i32,
    program: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    kubeconfig: PathBuf,
}

impl ApiServer {
    /// The running kube-apiserver that serves `cp` (its `--secure-port`).
    pub fn of(cp: &ControlPlane) -> ApiServer {
        let port = super::capi::socket_addr_of(&cp.server).port();
        let wanted = format!("--secure-port={port}");
        let program = cp.bin.join("kube-apiserver");
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let argv: Vec<String> = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if argv.first().map(PathBuf::from).as_deref() == Some(program.as_path())
                && argv.iter().any(|a| a == &wanted)
                && state_of(pid).is_some_and(|s| s != 'Z')
            {
                found.push((pid, argv));
            }
        }
        assert_eq!(
            found.len(),
            1,
            "exactly one live kube-apiserver with {wanted}: {:?}",
            found.iter().map(|(p, _)| p).collect::<Vec<_>>()
        );
        let (pid, argv) = found.remove(0);
        ApiServer {
            pid,
            program,
            args: argv[1..].to_vec(),
            log: cp.apiserver_log.clone(),
            kubeconfig: cp.admin_kubeconfig().to_path_buf(),
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: sending a signal to a PID this process started (it stays a zombie, so the PID is
        // not reused, until the harness reaps it at exit).
        let rc = unsafe { libc::kill(self.pid, signal) };
        assert_eq!(
            rc,
            0,
            "kill({}, {signal}): {}",
            self.pid,
            std::io::Error::last_os_error()
        );
    }

    /// SIGSTOP: the process keeps its sockets (the kernel still accepts connections and buffers
    /// bytes) but does nothing.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`stop`](Self::stop).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// SIGKILL, then the same binary with the same flags (same port, same etcd); returns once
    /// /readyz answers ok, with how long the restart took.
    pub async fn kill_and_restart(&mut self) -> Duration {
        let started = Instant::now();
        self.signal(libc::SIGKILL);
        poll_until(
            "the killed kube-apiserver to die",
            Duration::from_secs(10),
            Duration::from_millis(10),
            || {
                let state = state_of(self.pid);
                async move {
                    match state {
                        None | Some('Z') | Some('X') => Check::Done(()),
                        Some(s) => Check::Wait(format!("state {s}")),
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        // The port may be in use for a moment: retry the start a few times.
        for attempt in 1..=5 {
            let child = procs::spawn_logged(&self.program, &self.args, &self.log)
                .unwrap_or_else(|e| panic!("restart kube-apiserver: {e}"));
            self.pid = child.id() as i32;
            let pid = procs::keep_until_exit(child);
            match self.wait_ready(Duration::from_secs(60)).await {
                Ok(()) => return started.elapsed(),
                Err(e) => {
                    let tail = procs::log_tail(&self.log, 4000);
                    if attempt < 5 && state_of(pid as i32).is_none_or(|s| s == 'Z') {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        continue;
                    }
                    panic!("kube-apiserver did not come back: {e}\n{tail}");
                }
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// Polls /readyz with the admin identity until it answers "ok".
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        let client = client_from_kubeconfig(&self.kubeconfig).await;
        let pid = self.pid;
        poll_until(
            "kube-apiserver /readyz",
            timeout,
            Duration::from_millis(100),
            || {
                let client = client.clone();
                async move {
                    if state_of(pid).is_none_or(|s| s == 'Z') {
                        return Check::Fatal("kube-apiserver exited".into());
                    }
                    let request = http::Request::get("/readyz")
                        .body(Vec::new())
                        .expect("a GET request");
                    match tokio::time::timeout(Duration::from_secs(3), client.request_text(request))
                        .await
                    {
                        Ok(Ok(body)) if body.trim() == "ok" => Check::Done(()),
                        Ok(Ok(body)) => Check::Wait(body),
                        Ok(Err(e)) => Check::Wait(e.to_string()),
                        Err(_) => Check::Wait("no answer within 3s".into()),
                    }
                }
            },
        )
        .await
    }
}

impl ApiServer {
    /// The etcd client URL the apiserver was started with.
    pub fn etcd_url(&self) -> String {
        self.args
            .iter()
            .find_map(|a| a.strip_prefix("--etcd-servers="))
            .expect("kube-apiserver runs with --etcd-servers")
            .split(',')
            .next()
            .unwrap_or_default()
            .to_string()
    }
}

/// Every version etcd holds of a namespaced custom resource (`group`/`plural`), oldest first, read
/// by walking back from the latest through each version's `mod_revision` (etcd keeps every revision
/// until the apiserver compacts, which spares at least the last 5 minutes). Independent of the
/// apiserver: versions written around an apiserver restart are all there.
pub async fn etcd_versions(
    etcd_url: &str,
    group: &str,
    plural: &str,
    namespace: &str,
    name: &str,
    min_key: &str,
    max_key: &str,
) -> Result<Vec<Version>, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let address = etcd_url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let key = format!("/registry/{group}/{plural}/{namespace}/{name}");
    let mut versions = Vec::new();
    let mut revision: i64 = 0; // 0: the latest
    loop {
        let mut body = serde_json::json!({"key": b64.encode(&key)});
        if revision > 0 {
            body["revision"] = serde_json::json!(revision.to_string());
        }
        let answer = etcd_post(&address, "/v3/kv/range", &body.to_string()).await?;
        let answer: serde_json::Value = serde_json::from_str(&answer)
            .map_err(|e| format!("etcd range answer {answer:?}: {e}"))?;
        if let Some(error) = answer.get("error").or_else(|| answer.get("message")) {
            return Err(format!("etcd range {key}@{revision}: {error}"));
        }
        let Some(kv) = answer["kvs"].as_array().and_then(|a| a.first()) else {
            break; // before the object was created
        };
        let number = |v: &serde_json::Value| -> i64 {
            v.as_str()
                .and_then(|s| s.parse().ok())
                .or_else(|| v.as_i64())
                .unwrap_or(0)
        };
        let modified = number(&kv["mod_revision"]);
        let value = b64
            .decode(kv["value"].as_str().unwrap_or_default())
            .map_err(|e| format!("etcd value of {key}: {e}"))?;
        let object: DynamicObject = serde_json::from_slice(&value)
            .map_err(|e| format!("{key}@{modified} is not a JSON object: {e}"))?;
        let mut version = version_of(&object, min_key, max_key);
        // etcd's revision is the resourceVersion the apiserver reports for it.
        version.resource_version = modified.to_string();
        versions.push(version);
        if modified <= 1 || number(&kv["create_revision"]) == modified {
            break;
        }
        revision = modified - 1;
    }
    versions.reverse();
    Ok(versions)
}

async fn etcd_post(address: &str, path: &str, body: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(address)
        .await
        .map_err(|e| format!("connect to etcd at {address}: {e}"))?;
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("etcd request: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .map_err(|e| format!("etcd answer: {e}"))?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP answer from etcd: {text:?}"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!("etcd {path}: {head}: {body}"));
    }
    Ok(body.to_string())
}

/// Invariant 2 over one object's versions, oldest first: every version whose replicas differ from
/// the previous one (a replica write) lies within that version's own bounds, which are those of the
/// version written over (the writer of replicas does not touch the bounds). The violations.
pub fn bound_violations(versions: &[Version]) -> Vec<String> {
    versions
        .windows(2)
        .filter(|w| w[0].replicas != w[1].replicas)
        .filter_map(|w| {
            let v = &w[1];
            let (r, min, max) = (v.replicas?, v.min?, v.max?);
            (r < min || r > max).then(|| {
                format!(
                    "{} rv {}: replicas {r} outside [{min}, {max}] (previous version: {:?})",
                    v.name, v.resource_version, w[0]
                )
            })
        })
        .collect()
}

/// The state letter of /proc/<pid>/stat (`R`, `S`, `T`, `Z`, …), `None` when there is no such process.
fn state_of(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

// ---------------------------------------------------------------------------------------------------
// Group state, as the invariants see it.

/// A Machine as the invariants need it.
#[derive(Clone, Debug)]
pub struct MachineView {
    pub name: String,
    pub deleting: bool,
    /// The delete-machine annotation's value.
    pub mark: Option<String>,
}

impl MachineView {
    pub fn ours(&self) -> bool {
        self.mark
            .as_deref()
            .is_some_and(|m| m.ends_with(OUR_MARK_SUFFIX))
    }
}

/// A group object (MachineDeployment or MachinePool) and its Machines, read from the API.
#[derive(Clone, Debug)]
pub struct GroupView {
    pub replicas: i64,
    pub min: i64,
    pub max: i64,
    pub resource_version: String,
    pub ledger: BTreeSet<String>,
    /// For a MachinePool: `spec.providerIDList`.
    pub provider_ids: Vec<String>,
    pub machines: Vec<MachineView>,
}

impl GroupView {
    /// Reads the group object first, then its Machines: a removal marks before it decrements, so a
    /// removal in flight can only make marks look ahead of replicas, never behind.
    pub async fn read(capi: &Capi, kind: Kind, name: &str) -> Result<GroupView, String> {
        let object = capi
            .api(kind)
            .get(name)
            .await
            .map_err(|e| format!("get {} {name}: {e}", kind.as_str()))?;
        let annotations = object.metadata.annotations.clone().unwrap_or_default();
        let bound = |key: String| {
            annotations
                .get(&key)
                .and_then(|v| v.parse::<i64>().ok())
                .ok_or_else(|| format!("{} {name}: no integer {key}", kind.as_str()))
        };
        let replicas = object.data["spec"]["replicas"]
            .as_i64()
            .ok_or_else(|| format!("{} {name}: no spec.replicas", kind.as_str()))?;
        let ledger = annotations
            .get(LEDGER_ANNOTATION)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let provider_ids = object.data["spec"]["providerIDList"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let machines = match kind {
            Kind::MachineDeployment => {
                let selector = format!("{}={name}", capi.key("deployment-name"));
                capi.api(Kind::Machine)
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .map_err(|e| format!("list Machines of {name}: {e}"))?
                    .items
                    .into_iter()
                    .map(|m| machine_view(capi, &m))
                    .collect()
            }
            _ => Vec::new(),
        };
        Ok(GroupView {
            replicas,
            min: bound(capi.min_key())?,
            max: bound(capi.max_key())?,
            resource_version: object.metadata.resource_version.clone().unwrap_or_default(),
            ledger,
            provider_ids,
            machines,
        })
    }

    /// Machines not being deleted.
    pub fn active(&self) -> usize {
        self.machines.iter().filter(|m| !m.deleting).count()
    }

    /// Machines not being deleted that carry our mark, by name.
    pub fn marked(&self) -> BTreeSet<String> {
        self.machines
            .iter()
            .filter(|m| !m.deleting && m.ours())
            .map(|m| m.name.clone())
            .collect()
    }

    /// Machines beyond replicas: the removals replicas pay for.
    pub fn surplus(&self) -> i64 {
        (self.active() as i64 - self.replicas).max(0)
    }

    /// Our marks on active Machines beyond what replicas pay for: unpaid marks.
    pub fn unpaid(&self) -> i64 {
        (self.marked().len() as i64 - self.surplus()).max(0)
    }

    /// Of our marks on active Machines, those written at least `age_secs` ago.
    pub fn marks_older_than(&self, age_secs: u64) -> usize {
        let now = now_unix();
        self.machines
            .iter()
            .filter(|m| !m.deleting)
            .filter_map(|m| m.mark.as_deref().and_then(our_mark_time))
            .filter(|t| now.saturating_sub(*t) >= age_secs)
            .count()
    }

    /// Invariant 2 on this version: replicas within its own bounds.
    pub fn within_bounds(&self) -> bool {
        self.min <= self.replicas && self.replicas <= self.max
    }

    pub fn describe(&self) -> String {
        format!(
            "replicas {} [{}, {}] rv {}, {} active Machines, ours marked {:?}, ledger {:?}",
            self.replicas,
            self.min,
            self.max,
            self.resource_version,
            self.active(),
            self.marked(),
            self.ledger
        )
    }
}

fn machine_view(capi: &Capi, m: &DynamicObject) -> MachineView {
    MachineView {
        name: m.metadata.name.clone().unwrap_or_default(),
        deleting: m.metadata.deletion_timestamp.is_some(),
        mark: m
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&capi.delete_key()))
            .cloned(),
    }
}

// ---------------------------------------------------------------------------------------------------
// Every version of the groups of a namespace.

/// One version of a group object, as a watch delivered it.
#[derive(Clone, Debug)]
pub struct Version {
    pub name: String,
    pub resource_version: String,
    pub replicas: Option<i64>,
    pub min: Option<i64>,
    pub max: Option<i64>,
}

#[derive(Default)]
struct HistoryShared {
    versions: Vec<Version>,
    /// Watch restarts that had to re-list (a gap: versions in between may be missing).
    gaps: usize,
    resumed: usize,
}

/// Every version of the objects of one kind in a namespace, from a watch that resumes from the last
/// resourceVersion it saw (so versions written while the apiserver was down or stopped are still
/// delivered afterwards). Stopped when dropped.
pub struct History {
    shared: Arc<Mutex<HistoryShared>>,
    task: JoinHandle<()>,
    checked: usize,
    last: BTreeMap<String, Version>,
}

impl History {
    pub async fn start(capi: &Capi, kind: Kind) -> History {
        let api = capi.api(kind);
        let (min_key, max_key) = (capi.min_key(), capi.max_key());
        let shared = Arc::new(Mutex::new(HistoryShared::default()));
        let record = Arc::clone(&shared);
        let task = watch_resuming(api, move |seen| match seen {
            Watched::Listed { objects, relisted } => {
                let mut s = lock(&record);
                // After a 410 the versions in between are lost; counted.
                s.gaps += usize::from(relisted);
                for o in objects {
                    s.versions.push(version_of(o, &min_key, &max_key));
                }
            }
            Watched::Changed(o) => lock(&record)
                .versions
                .push(version_of(o, &min_key, &max_key)),
            Watched::Deleted(_) => {}
            Watched::Resumed => lock(&record).resumed += 1,
        })
        .await;
        History {
            shared,
            task,
            checked: 0,
            last: BTreeMap::new(),
        }
    }

    /// Every version seen so far.
    pub fn versions(&self) -> Vec<Version> {
        lock(&self.shared).versions.clone()
    }

    /// How often the watch had to re-list (versions may be missing in between).
    pub fn gaps(&self) -> usize {
        lock(&self.shared).gaps
    }

    /// Invariant 2 on the versions that arrived since the last call: each version whose replicas
    /// differ from the previous version of the same object (a replica write; only the provider
    /// writes replicas in these tests, and it never touches the bounds) lies within the bounds of
    /// that same version, which are those of the version it was written over. Returns how many
    /// versions were checked, or the violations.
    pub fn check_new(&mut self) -> Result<usize, String> {
        let fresh: Vec<Version> = {
            let shared = lock(&self.shared);
            shared.versions[self.checked.min(shared.versions.len())..].to_vec()
        };
        self.checked += fresh.len();
        let mut violations = Vec::new();
        for v in &fresh {
            let prev = self.last.insert(v.name.clone(), v.clone());
            let Some(prev) = prev else { continue };
            if prev.replicas == v.replicas {
                continue;
            }
            if let (Some(r), Some(min), Some(max)) = (v.replicas, v.min, v.max)
                && (r < min || r > max)
            {
                violations.push(format!(
                    "{} rv {}: replicas {r} outside [{min}, {max}] (previous version: {prev:?})",
                    v.name, v.resource_version
                ));
            }
        }
        if violations.is_empty() {
            Ok(fresh.len())
        } else {
            Err(violations.join("\n"))
        }
    }
}

impl Drop for History {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn version_of(o: &DynamicObject, min_key: &str, max_key: &str) -> Version {
    let annotations = o.metadata.annotations.clone().unwrap_or_default();
    let int = |k: &str| annotations.get(k).and_then(|v| v.parse::<i64>().ok());
    Version {
        name: o.metadata.name.clone().unwrap_or_default(),
        resource_version: o.metadata.resource_version.clone().unwrap_or_default(),
        replicas: o.data["spec"]["replicas"].as_i64(),
        min: int(min_key),
        max: int(max_key),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------------------
// The provider's metrics.

/// The value of the provider's series starting with `series` (e.g.
/// `capi_autoscaler_provider_api_writes_total{operation="delete-nodes",outcome="conflict"}`),
/// 0 when it is not there yet.
pub async fn provider_metric(metrics_address: &str, series: &str) -> f64 {
    let mut stream = TcpStream::connect(metrics_address)
        .await
        .unwrap_or_else(|e| panic!("connect to the provider's metrics at {metrics_address}: {e}"));
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {metrics_address}\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send GET /metrics");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .expect("read /metrics");
    let text = String::from_utf8_lossy(&response);
    text.lines()
        .filter_map(|l| l.strip_prefix(series))
        .filter_map(|rest| rest.trim().parse::<f64>().ok())
        .sum()
}

/// A client whose requests give up after `timeout` (the harness's clients retry and wait longer).
pub async fn short_client(kubeconfig: &std::path::Path, timeout: Duration) -> Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig).expect("read kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("load kubeconfig");
    config.connect_timeout = Some(timeout);
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    Client::try_from(config).expect("a client")
}

/// Creates an `Api` over `kind` in `capi`'s namespace with `client`.
pub fn api_with(capi: &Capi, client: &Client, kind: Kind) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), &capi.ns, &capi.resource(kind))
}
