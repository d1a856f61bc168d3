//! Child processes that never outlive the test binary, the per-run work directory, free ports and
//! polling with a deadline.
//!
//! Every child is spawned by one dedicated thread that lives as long as the process, with
//! `PR_SET_PDEATHSIG = SIGKILL`: when the test binary ends for any reason (normal exit, a panic,
//! a signal, even SIGKILL) the kernel kills the children. On a normal exit an `atexit` handler also
//! kills the registered children by PID, reaps them and removes the work directories.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Prefix of every directory this harness creates (followed by the owning PID).
const DIR_PREFIX: &str = "capi-e2e-";

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// The sender side of the spawner thread's queue.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("e2e-spawner".into())
            .spawn(move || {
                // The parent of every child is this thread: it must never exit before the process.
                for (mut command, reply) in rx {
                    // SAFETY: the closure runs between fork and exec and only calls
                    // async-signal-safe functions (prctl, getppid, kill of itself).
                    unsafe {
                        command.pre_exec(|| {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                                return Err(io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(command.spawn());
                }
                // The senders live in a static, so the loop never ends; park to be safe.
                loop {
                    std::thread::park();
                }
            })
            .expect("start the e2e spawner thread");
        install_exit_handler();
        Mutex::new(tx)
    })
}

/// Spawns `command` from the long-lived spawner thread, so that the child dies with the test binary.
pub fn spawn(command: Command) -> io::Result<Child> {
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, tx))
        .map_err(|_| io::Error::other("e2e spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("e2e spawner thread did not answer"))?
}

/// Spawns `program args…` with stdin closed and stdout+stderr appended to `log`.
pub fn spawn_logged(program: &Path, args: &[String], log: &Path) -> io::Result<Child> {
    let out = File::options().create(true).append(true).open(log)?;
    let err = out.try_clone()?;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    spawn(command)
}

/// Like [`spawn_logged`], in a UTS namespace of its own whose hostname is `hostname`, as in a pod
/// (needs root). Programs that take their identity from the hostname, as cluster-autoscaler's leader
/// election does, are then told apart as pods are; on one host they would all be the same candidate.
/// The returned child is the program itself (`unshare` and the shell exec into it).
pub fn spawn_logged_on_host(
    hostname: &str,
    program: &Path,
    args: &[String],
    log: &Path,
) -> io::Result<Child> {
    let mut wrapped: Vec<String> = vec![
        "--uts".into(),
        "sh".into(),
        "-c".into(),
        "hostname \"$1\" && shift && exec \"$@\"".into(),
        "sh".into(),
        hostname.into(),
        program.display().to_string(),
    ];
    wrapped.extend(args.iter().cloned());
    spawn_logged(Path::new("unshare"), &wrapped, log)
}

/// Children that stay up until the binary exits (etcd, kube-apiserver); killed by the exit handler.
fn registry() -> &'static Mutex<Vec<Child>> {
    static CHILDREN: OnceLock<Mutex<Vec<Child>>> = OnceLock::new();
    CHILDREN.get_or_init(|| Mutex::new(Vec::new()))
}

/// Keeps `child` alive until the test binary exits; returns its PID.
pub fn keep_until_exit(child: Child) -> u32 {
    let pid = child.id();
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(child);
    pid
}

/// Kills `child` with SIGKILL and reaps it. Errors (already gone) are ignored.
pub fn kill_and_reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Directories removed at exit: `(path, keep_on_failure)`.
fn cleanup_dirs() -> &'static Mutex<Vec<(PathBuf, bool)>> {
    static DIRS: OnceLock<Mutex<Vec<(PathBuf, bool)>>> = OnceLock::new();
    DIRS.get_or_init(|| Mutex::new(Vec::new()))
}

static FAILED: AtomicBool = AtomicBool::new(false);

/// Marks the run as failed: the work directory (logs) is kept at exit and its path printed.
pub fn mark_failed() {
    FAILED.store(true, Ordering::SeqCst);
}

fn install_exit_handler() {
    // Any panic (a failing test) keeps the logs.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        mark_failed();
        previous(info);
    }));
    extern "C" fn at_exit() {
        if let Ok(mut children) = registry().try_lock() {
            // Reverse start order: kube-apiserver before etcd.
            for child in children.iter_mut().rev() {
                kill_and_reap(child);
            }
            children.clear();
        }
        let failed = FAILED.load(Ordering::SeqCst) || std::env::var_os("CAPI_E2E_KEEP").is_some();
        if let Ok(dirs) = cleanup_dirs().try_lock() {
            for (dir, keep_on_failure) in dirs.iter() {
                if failed && *keep_on_failure {
                    eprintln!("e2e: kept logs and state in {}", dir.display());
                } else {
                    let _ = std::fs::remove_dir_all(dir);
                }
            }
        }
    }
    // SAFETY: registering a plain extern "C" function without captured state.
    unsafe {
        libc::atexit(at_exit);
    }
}

fn new_dir(parent: &Path, keep_on_failure: bool) -> PathBuf {
    // Make sure the exit handler is installed before anything is created.
    let _ = spawner();
    let dir = tempfile::Builder::new()
        .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
        .tempdir_in(parent)
        .unwrap_or_else(|e| panic!("create a work directory in {}: {e}", parent.display()))
        .keep();
    cleanup_dirs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((dir.clone(), keep_on_failure));
    dir
}

/// The releases a build script pins beside its own go.mod: each subdirectory of `dir` (relative to
/// the repository) with a go.mod of its own, by name (`tests/upstream/capi` → `v1.13`).
pub fn pinned_subdirectories(dir: &str) -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut pins: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("go.mod").is_file())
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(String::from))
        .collect();
    pins.sort();
    pins
}

/// This test binary's work directory (certificates, kubeconfigs, logs) in the system temp dir.
/// Removed at exit unless a test failed or `CAPI_E2E_KEEP` is set.
pub fn work_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| new_dir(&std::env::temp_dir(), true))
}

/// A fresh directory for etcd data: in /dev/shm when it exists (memory, no fsync), always removed
/// at exit. Leftovers of test binaries that were killed are swept first.
pub fn scratch_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let parent = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    sweep_stale(&parent);
    new_dir(&parent, false)
}

/// Removes `capi-e2e-<pid>-*` directories whose owning process no longer exists.
fn sweep_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago. Callers retry when it is taken meanwhile.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0 to find a free port")
}

/// The last `max` bytes of a log file, for failure messages.
pub fn log_tail(path: &Path, max: u64) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// One look at a condition, for [`poll_until`].
pub enum Check<T> {
    /// The condition holds.
    Done(T),
    /// Not yet; the reason is reported if the deadline passes.
    Wait(String),
    /// A definite failure: stop polling.
    Fatal(String),
}

/// Polls `check` every `interval` until it is `Done`, it is `Fatal` (returned at once), or `timeout`
/// passes (then the last `Wait` reason is returned).
pub async fn poll_until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut check: F,
) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Check<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check().await {
            Check::Done(value) => return Ok(value),
            Check::Wait(reason) => reason,
            Check::Fatal(reason) => return Err(format!("{what}: {reason}")),
        };
        if Instant::now() >= deadline {
            return Err(format!("{what}: not done after {timeout:?}; last: {last}"));
        }
        tokio::time::sleep(interval).await;
    }
}

/// Polls until `child` exits on its own, for at most `timeout`; the process is left running otherwise.
pub async fn wait_exit(
    child: &mut Child,
    what: &str,
    timeout: Duration,
) -> Result<std::process::ExitStatus, String> {
    poll_until(what, timeout, Duration::from_millis(20), || {
        let status = child.try_wait();
        async move {
            match status {
                Ok(Some(status)) => Check::Done(status),
                Ok(None) => Check::Wait("still running".into()),
                Err(e) => Check::Fatal(format!("wait: {e}")),
            }
        }
    })
    .await
}

/// Writes `text` (and a newline) to the process's stderr past libtest's output capture, so that
/// figures such as a scenario's wall time show in every run, not only in failing ones.
pub fn announce(text: &str) {
    use std::io::Write as _;
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "{text}");
}

/// `GET path` on `address` (plain HTTP/1.0 on loopback, 5 s at most): the status code and the body.
pub async fn http_get(address: &str, path: &str) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| format!("connect {address}: {e}"))?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut response = Vec::new();
        stream
            .read_to_end(&mut response)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&response).into_owned();
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("not an HTTP response: {text:?}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((code, body))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| format!("GET {address}{path}: timed out"))?
}

/// Runs `script` (an upstream build script under tests/upstream: it builds on first use, else
/// answers at once) with `args`, niced when `nice`, and returns the cache dir it prints once that
/// holds a finished build (its `ready` file).
pub fn finished_cache_dir(script: &Path, args: &[&str], nice: bool) -> Result<PathBuf, String> {
    let mut command = if nice {
        let mut c = Command::new("nice");
        c.arg("bash");
        c
    } else {
        Command::new("bash")
    };
    let out = command
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed: {}", script.display(), out.status));
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !dir.join("ready").is_file() {
        return Err(format!(
            "{} printed {}, which is not a finished cache dir",
            script.display(),
            dir.display()
        ));
    }
    Ok(dir)
}

/// Why `child` is gone (it exited, or cannot be waited for), `None` while it runs.
pub fn gone(child: &mut Child) -> Option<String> {
    match child.try_wait() {
        Ok(Some(status)) => Some(format!("exited with {status}")),
        Ok(None) => None,
        Err(e) => Some(format!("wait: {e}")),
    }
}
