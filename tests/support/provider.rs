//! Runs this crate's binary (`serve`) as a child process for a test.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::procs::{self, Check, poll_until};

/// The provider binary: the one cargo built for this test run; from an example (where cargo sets no
/// `CARGO_BIN_EXE_*`) `target/debug/capi-autoscaler-provider`, which `make demo` builds first.
pub const PROVIDER_BIN: &str = match option_env!("CARGO_BIN_EXE_capi-autoscaler-provider") {
    Some(path) => path,
    None => concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/debug/capi-autoscaler-provider"
    ),
};

/// A running provider; killed (SIGKILL) and reaped on drop.
pub struct ProviderProcess {
    child: Child,
    /// `127.0.0.1:<port>` of the gRPC listener.
    pub address: String,
    /// `127.0.0.1:<port>` of the metrics/health HTTP listener.
    pub metrics_address: String,
    /// stdout and stderr of the provider.
    pub log: PathBuf,
    /// How long it took until the health check answered SERVING.
    pub startup: Duration,
}

impl ProviderProcess {
    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// A new channel to the gRPC listener, in the calling test's runtime.
    pub async fn channel(&self) -> Channel {
        Endpoint::from_shared(self.endpoint())
            .expect("provider endpoint URI")
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to the provider at {}: {e}", self.address))
    }

    /// The log so far.
    pub fn log_contents(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (60 s at most) until grpc.health.v1 answers SERVING for `service`, e.g. the
    /// CloudProvider service, which the provider reports only once its caches have listed; panics
    /// with the provider's log otherwise.
    pub async fn wait_serving(&mut self, service: &str) {
        if let Err(e) = wait_serving(&mut self.child, &self.address, service, None).await {
            panic!(
                "{e}\n--- provider log {} ---\n{}",
                self.log.display(),
                procs::log_tail(&self.log, 6000)
            );
        }
    }

    /// The PID of the provider process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM, as the kubelet does to a terminating pod's containers.
    pub fn terminate(&self) {
        // SAFETY: kill(2) with a PID of our own child, which is not reaped before drop.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }

    /// Waits (at most `timeout`) until the provider has exited; its exit status.
    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> Result<std::process::ExitStatus, String> {
        procs::wait_exit(&mut self.child, "the provider exits", timeout).await
    }

    /// The exit status once the provider has exited, without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills (SIGKILL) and reaps it, as the kubelet does when the grace period is over.
    pub fn kill(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }

    /// How many established TCP connections the provider holds to `port` on 127.0.0.1: its sockets
    /// (`/proc/<pid>/fd`) matched by inode against the kernel's table (`/proc/<pid>/net/tcp`).
    pub fn connections_to(&self, port: u16) -> usize {
        let pid = self.pid();
        let sockets: std::collections::BTreeSet<String> =
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .filter_map(|target| {
                    let target = target.to_string_lossy().into_owned();
                    let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
                    Some(inode.to_string())
                })
                .collect();
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp"))
            .unwrap_or_else(|e| panic!("/proc/{pid}/net/tcp: {e}"));
        let remote = format!("0100007F:{port:04X}");
        table
            .lines()
            .skip(1)
            .filter(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // rem_address, st (01: ESTABLISHED), inode
                fields.len() > 9
                    && fields[2] == remote
                    && fields[3] == "01"
                    && sockets.contains(fields[9])
            })
            .count()
    }
}

impl Drop for ProviderProcess {
    fn drop(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }
}

/// Starts `capi-autoscaler-provider serve --address 127.0.0.1:<free> --metrics-address
/// 127.0.0.1:<free> --cloud-config <kubeconfig> <args…>` and waits until grpc.health.v1 answers
/// SERVING for the whole server (service ""). Panics with the provider's log when it exits or
/// does not become healthy within 60 s.
pub async fn start_provider(args: &[&str], kubeconfig: &Path) -> ProviderProcess {
    start(args, kubeconfig, None).await
}

/// [`start_provider`] for a provider whose `args` make it serve TLS: the health check connects with
/// `tls` (the server's CA and, for mTLS, a client identity).
pub async fn start_provider_tls(
    args: &[&str],
    kubeconfig: &Path,
    tls: ClientTlsConfig,
) -> ProviderProcess {
    start(args, kubeconfig, Some(tls)).await
}

/// Starts `serve` like [`start_provider`] but returns at once, without waiting for health: for
/// tests that race the provider's start.
pub fn spawn_provider(args: &[&str], kubeconfig: &Path) -> ProviderProcess {
    spawn(args, kubeconfig, "spawned")
}

/// Spawns `serve --address … --metrics-address … --cloud-config <kubeconfig> <args…>` on free
/// loopback ports, its log in `provider-<label>-<n>.log`.
fn spawn(args: &[&str], kubeconfig: &Path, label: &str) -> ProviderProcess {
    static COUNT: AtomicU32 = AtomicU32::new(0);
    let n = COUNT.fetch_add(1, Ordering::SeqCst);
    let log = procs::work_dir().join(format!("provider-{label}-{n}.log"));
    let address = format!("127.0.0.1:{}", procs::free_port());
    let metrics_address = format!("127.0.0.1:{}", procs::free_port());
    let mut argv: Vec<String> = vec![
        "serve".into(),
        "--address".into(),
        address.clone(),
        "--metrics-address".into(),
        metrics_address.clone(),
        "--cloud-config".into(),
        kubeconfig.display().to_string(),
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    let child = procs::spawn_logged(Path::new(PROVIDER_BIN), &argv, &log)
        .unwrap_or_else(|e| panic!("start {PROVIDER_BIN} {}: {e}", argv.join(" ")));
    ProviderProcess {
        child,
        address,
        metrics_address,
        log,
        startup: Duration::ZERO,
    }
}

async fn start(args: &[&str], kubeconfig: &Path, tls: Option<ClientTlsConfig>) -> ProviderProcess {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let started = Instant::now();
        let mut provider = spawn(args, kubeconfig, "serve");
        match wait_serving(&mut provider.child, &provider.address, "", tls.clone()).await {
            Ok(()) => {
                provider.startup = started.elapsed();
                eprintln!(
                    "e2e: provider {} serving after {:.2}s (log {})",
                    provider.address,
                    provider.startup.as_secs_f64(),
                    provider.log.display()
                );
                return provider;
            }
            Err(e) => {
                procs::kill_and_reap(&mut provider.child);
                let tail = procs::log_tail(&provider.log, 6000);
                if attempt < 3 && tail.contains("in use") {
                    continue; // a port was taken between choosing and binding
                }
                panic!(
                    "provider `{PROVIDER_BIN} serve {}` did not become healthy: {e}\n--- provider log {} ---\n{tail}",
                    args.join(" "),
                    provider.log.display()
                );
            }
        }
    }
}

async fn wait_serving(
    child: &mut Child,
    address: &str,
    service: &str,
    tls: Option<ClientTlsConfig>,
) -> Result<(), String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(2));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    poll_until(
        &format!("provider health of {service:?} at {address}"),
        Duration::from_secs(60),
        Duration::from_millis(50),
        || {
            let gone = procs::gone(child).map(|why| format!("the provider: {why}"));
            let endpoint = endpoint.clone();
            async move {
                if let Some(gone) = gone {
                    return Check::Fatal(gone);
                }
                match health_status(endpoint, service).await {
                    Ok(ServingStatus::Serving) => Check::Done(()),
                    Ok(other) => Check::Wait(format!("status {other:?}")),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
}

/// One grpc.health.v1 `Check` of `service` ("" = the whole server).
pub async fn health_status(endpoint: Endpoint, service: &str) -> Result<ServingStatus, String> {
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map_err(|e| format!("health check: {e}"))?;
    Ok(ServingStatus::try_from(response.into_inner().status).unwrap_or(ServingStatus::Unknown))
}
