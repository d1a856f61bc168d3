//! What the topology tests (tests/topology.rs) need besides the scenario harness: a stand-in for a
//! Service and kube-proxy in front of several provider replicas, and the history of cluster-autoscaler's
//! leader Lease.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::{Api, Client};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::procs::{Check, poll_until};

// ---------------------------------------------------------------------------------------------------
// A Service in front of provider replicas.

#[derive(Default)]
struct ServiceShared {
    /// The ready endpoints, oldest first.
    endpoints: Mutex<Vec<SocketAddr>>,
    /// The endpoint of each connection accepted so far, in order.
    connections: Mutex<Vec<SocketAddr>>,
}

/// A ClusterIP Service as kube-proxy makes it: each new connection goes to one of the ready
/// endpoints and stays with it until either side closes it, also after the endpoint has left the
/// list (conntrack keeps established flows). A connection that arrives while no endpoint is ready is
/// closed at once. Where kube-proxy picks an endpoint at random, this one picks the oldest: during a
/// rolling update a client stays on an old replica as long as there is one, and so is moved at every
/// step, the worst case.
pub struct Service {
    pub addr: SocketAddr,
    shared: Arc<ServiceShared>,
    task: JoinHandle<()>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Service {
    /// Listens on a free port of 127.0.0.1, forwarding to `endpoints`.
    pub async fn start(endpoints: &[SocketAddr]) -> Service {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind the Service on 127.0.0.1");
        let addr = listener.local_addr().expect("the Service's address");
        let shared = Arc::new(ServiceShared::default());
        *lock(&shared.endpoints) = endpoints.to_vec();
        let task = tokio::spawn({
            let shared = Arc::clone(&shared);
            async move {
                let mut flows = tokio::task::JoinSet::new();
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    let target = {
                        let endpoints = lock(&shared.endpoints);
                        if endpoints.is_empty() {
                            continue;
                        }
                        endpoints[0]
                    };
                    lock(&shared.connections).push(target);
                    flows.spawn(async move {
                        if let Ok(mut outbound) = TcpStream::connect(target).await {
                            let _ = inbound.set_nodelay(true);
                            let _ = outbound.set_nodelay(true);
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                    });
                    while flows.try_join_next().is_some() {}
                }
            }
        });
        Service { addr, shared, task }
    }

    /// `127.0.0.1:<port>`, for CA's cloud-config.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// An endpoint became ready (its readiness probe passed).
    pub fn add(&self, endpoint: SocketAddr) {
        lock(&self.shared.endpoints).push(endpoint);
    }

    /// An endpoint left the list (its pod is terminating).
    pub fn remove(&self, endpoint: SocketAddr) {
        lock(&self.shared.endpoints).retain(|e| *e != endpoint);
    }

    /// The endpoint of every connection accepted so far, in order.
    pub fn connections(&self) -> Vec<SocketAddr> {
        lock(&self.shared.connections).clone()
    }
}

// ---------------------------------------------------------------------------------------------------
// CA's leader Lease.

/// One version of the Lease, as a watch delivered it.
#[derive(Clone, Debug)]
pub struct LeaseVersion {
    pub at: Instant,
    pub holder: Option<String>,
    pub transitions: i32,
}

/// Every version of Lease `name` in a namespace from its creation on, from a watch that resumes
/// from the last resourceVersion it saw. Stopped when dropped.
pub struct LeaseHistory {
    versions: Arc<Mutex<Vec<LeaseVersion>>>,
    /// Watches that had to start again from a fresh list: versions in between may be missing.
    gaps: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for LeaseHistory {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LeaseHistory {
    /// Starts watching (before any CA runs, so the first version is the one that created it).
    pub async fn start(client: &Client, ns: &str, name: &str) -> LeaseHistory {
        let api: Api<Lease> = Api::namespaced(client.clone(), ns);
        let versions = Arc::new(Mutex::new(Vec::new()));
        let gaps = Arc::new(AtomicUsize::new(0));
        let selector = format!("metadata.name={name}");
        let list = api
            .list(&ListParams::default().fields(&selector))
            .await
            .expect("list the Lease");
        {
            let mut v = lock(&versions);
            v.extend(list.items.iter().map(version_of));
        }
        let mut rv = list.metadata.resource_version.unwrap_or_default();
        let task = tokio::spawn({
            let versions = Arc::clone(&versions);
            let gaps = Arc::clone(&gaps);
            async move {
                loop {
                    let params = WatchParams::default().fields(&selector).timeout(290);
                    let mut expired = false;
                    if let Ok(stream) = api.watch(&params, &rv).await {
                        let mut stream = std::pin::pin!(stream);
                        while let Some(event) = stream.next().await {
                            match event {
                                Ok(WatchEvent::Added(l)) | Ok(WatchEvent::Modified(l)) => {
                                    rv = l.metadata.resource_version.clone().unwrap_or_default();
                                    lock(&versions).push(version_of(&l));
                                }
                                Ok(WatchEvent::Deleted(l)) => {
                                    rv = l.metadata.resource_version.clone().unwrap_or_default();
                                }
                                Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                                Ok(WatchEvent::Error(status)) => {
                                    expired = status.code == 410;
                                    break;
                                }
                                Err(_) => break,
                            }
                        }
                    }
                    if expired
                        && let Ok(list) = api.list(&ListParams::default().fields(&selector)).await
                    {
                        gaps.fetch_add(1, Ordering::SeqCst);
                        lock(&versions).extend(list.items.iter().map(version_of));
                        rv = list.metadata.resource_version.unwrap_or_default();
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        LeaseHistory {
            versions,
            gaps,
            task,
        }
    }

    /// Every version seen so far, oldest first.
    pub fn versions(&self) -> Vec<LeaseVersion> {
        lock(&self.versions).clone()
    }

    /// How often the watch had to re-list.
    pub fn gaps(&self) -> usize {
        self.gaps.load(Ordering::SeqCst)
    }

    /// The holders in the order they held the Lease (a holder repeated only when another held it in
    /// between; versions without a holder left out).
    pub fn holders(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for v in self.versions() {
            if let Some(h) = v.holder
                && out.last() != Some(&h)
            {
                out.push(h);
            }
        }
        out
    }

    /// Waits (at most `timeout`) until the Lease is held by someone other than `not`; the holder.
    pub async fn wait_holder_other_than(
        &self,
        not: Option<&str>,
        timeout: Duration,
    ) -> Result<String, String> {
        poll_until(
            &format!("the Lease held by someone other than {not:?}"),
            timeout,
            Duration::from_millis(20),
            || {
                let last = self.versions().last().and_then(|v| v.holder.clone());
                async move {
                    match last {
                        Some(h) if Some(h.as_str()) != not => Check::Done(h),
                        other => Check::Wait(format!("holder {other:?}")),
                    }
                }
            },
        )
        .await
    }
}

fn version_of(lease: &Lease) -> LeaseVersion {
    let spec = lease.spec.clone().unwrap_or_default();
    LeaseVersion {
        at: Instant::now(),
        holder: spec.holder_identity.filter(|h| !h.is_empty()),
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
