//! Helpers for tests/hardening.rs: the provider's memory from /proc, raw gRPC calls with hand-made
//! protobuf bytes (millions of elements without building millions of structs), a plain HTTP GET with
//! its body, ClusterRoleBindings taken away and given back, and a provider serving TLS from files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use prost::bytes::{Buf, BufMut, Bytes};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

use super::capi::{EnvProvider, spawn_provider};
use super::pki::{Ca, CertPem, write_private};
use super::procs::{self, Check, poll_until};

/// A field of `/proc/<pid>/status` in KiB (`VmRSS`, `VmHWM`).
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
}

/// The resident memory of `pid` in MiB; panics when the process is gone.
pub fn rss_mib(pid: u32) -> f64 {
    proc_status_kib(pid, "VmRSS")
        .unwrap_or_else(|| panic!("process {pid} is gone (no /proc/{pid}/status)")) as f64
        / 1024.0
}

/// The peak resident memory of `pid` so far, in MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    proc_status_kib(pid, "VmHWM")
        .unwrap_or_else(|| panic!("process {pid} is gone (no /proc/{pid}/status)")) as f64
        / 1024.0
}

/// A codec that sends bytes as they are (an already encoded message) and reads the answer as bytes.
#[derive(Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// A unary call of CloudProvider `method` with `message` as its encoded request.
pub async fn raw_call(channel: Channel, method: &str, message: Bytes) -> Result<Bytes, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    let path = format!("/clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider/{method}");
    let path = http::uri::PathAndQuery::try_from(path).expect("a valid gRPC path");
    grpc.unary(tonic::Request::new(message), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// Protobuf: `field` as a length-delimited field holding `payload`.
pub fn len_field(field: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 11);
    varint(&mut out, u64::from(field) << 3 | 2);
    varint(&mut out, payload.len() as u64);
    out.extend_from_slice(payload);
    out
}

fn varint(out: &mut Vec<u8>, mut n: u64) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Protobuf: `count` empty elements of repeated message field `field` (two bytes each).
pub fn empty_elements(field: u32, count: usize) -> Vec<u8> {
    let key = (field << 3 | 2) as u8;
    assert!(field < 16, "a one-byte key");
    std::iter::repeat_n([key, 0x00], count).flatten().collect()
}

/// Whether `result` failed with one of `codes`; panics with what it was otherwise.
#[track_caller]
pub fn expect_one_of<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, Status>,
    codes: &[Code],
) -> Status {
    match result {
        Err(status) if codes.contains(&status.code()) => status,
        other => panic!("{what}: expected one of {codes:?}, got {other:?}"),
    }
}

pub use super::procs::http_get;

/// The value of the metric line starting with `series` (e.g. `name{label="x"}`), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The user of a kubeconfig written by `ControlPlane::restricted_identity` (`<user>.kubeconfig`).
pub fn user_of(kubeconfig: &Path) -> String {
    kubeconfig
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_else(|| panic!("{} names no user", kubeconfig.display()))
        .to_string()
}

/// Deletes every ClusterRoleBinding that names `user` and returns them, to be given back with
/// [`restore_bindings`].
pub async fn revoke_bindings(admin: &Client, user: &str) -> Vec<ClusterRoleBinding> {
    let api: Api<ClusterRoleBinding> = Api::all(admin.clone());
    let bindings: Vec<ClusterRoleBinding> = api
        .list(&ListParams::default())
        .await
        .expect("list ClusterRoleBindings")
        .items
        .into_iter()
        .filter(|b| {
            b.subjects
                .iter()
                .flatten()
                .any(|s| s.kind == "User" && s.name == user)
        })
        .collect();
    assert!(!bindings.is_empty(), "no ClusterRoleBinding names {user}");
    for b in &bindings {
        let name = b.metadata.name.clone().unwrap_or_default();
        api.delete(&name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete ClusterRoleBinding {name}: {e}"));
    }
    bindings
}

/// Creates `bindings` again (as new objects).
pub async fn restore_bindings(admin: &Client, bindings: &[ClusterRoleBinding]) {
    let api: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in bindings {
        let mut fresh = b.clone();
        fresh.metadata = kube::api::ObjectMeta {
            name: b.metadata.name.clone(),
            ..Default::default()
        };
        api.create(&PostParams::default(), &fresh)
            .await
            .unwrap_or_else(|e| panic!("create ClusterRoleBinding {:?}: {e}", b.metadata.name));
    }
}

/// A server certificate (for 127.0.0.1 and localhost) and a client certificate from one CA.
pub struct TlsSet {
    pub ca: Ca,
    pub server: CertPem,
    pub client: CertPem,
}

impl TlsSet {
    pub fn generate() -> TlsSet {
        let ca = Ca::generate();
        let server = ca.serving_cert("capi-autoscaler-provider");
        let client = ca.client_cert("cluster-autoscaler", None);
        TlsSet { ca, server, client }
    }

    /// A client that trusts only this set's CA and presents this set's client certificate.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca.cert_pem))
            .identity(Identity::from_pem(&self.client.cert, &self.client.key))
            .domain_name("localhost")
    }
}

/// Where a provider reads its TLS files; written in place of each other as a rotation does
/// (a new file renamed over the old one, as the kubelet's atomic writer does).
pub struct TlsDir {
    pub dir: PathBuf,
}

impl TlsDir {
    pub fn create() -> TlsDir {
        TlsDir {
            dir: procs::scratch_dir(),
        }
    }

    pub fn cert(&self) -> PathBuf {
        self.dir.join("tls.crt")
    }

    pub fn key(&self) -> PathBuf {
        self.dir.join("tls.key")
    }

    pub fn client_ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// Replaces one file: written beside, then renamed over it.
    pub fn replace(&self, path: &Path, contents: &str) {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a file name");
        let staged = write_private(&self.dir, &format!(".{name}.new"), contents);
        std::fs::rename(&staged, path)
            .unwrap_or_else(|e| panic!("rename {} to {}: {e}", staged.display(), path.display()));
    }

    /// Server certificate, key and client CA of `set`.
    pub fn install(&self, set: &TlsSet) {
        self.replace(&self.cert(), &set.server.cert);
        self.replace(&self.key(), &set.server.key);
        self.replace(&self.client_ca(), &set.ca.cert_pem);
    }

    /// The provider flags that point at these files (mTLS).
    pub fn args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.cert().display().to_string(),
            "--tls-key".into(),
            self.key().display().to_string(),
            "--tls-client-ca".into(),
            self.client_ca().display().to_string(),
        ]
    }
}

/// A new TLS connection to `address` with `tls`.
pub async fn connect_tls(address: &str, tls: ClientTlsConfig) -> Result<Channel, String> {
    Endpoint::from_shared(format!("https://{address}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

/// Starts the provider serving mTLS from `files`, waits until a client of `set` gets NodeGroups
/// answered (60 s).
pub async fn start_tls_provider(
    kubeconfig: &Path,
    extra: &[String],
    files: &TlsDir,
    set: &TlsSet,
) -> EnvProvider {
    let mut args = files.args();
    args.extend(extra.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut provider = spawn_provider(&args, kubeconfig, &[]);
    let address = provider.address.clone();
    let log = provider.log.clone();
    let tls = set.client_config();
    let result = poll_until(
        "the provider answers NodeGroups over mTLS",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let gone = provider.exited();
            let (address, tls) = (address.clone(), tls.clone());
            async move {
                if let Some(status) = gone {
                    return Check::Fatal(format!("the provider exited with {status}"));
                }
                match node_groups_over(&address, tls).await {
                    Ok(_) => Check::Done(()),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await;
    if let Err(e) = result {
        panic!("{e}\n--- provider log ---\n{}", procs::log_tail(&log, 6000));
    }
    provider
}

/// NodeGroups on a new connection with `tls`: how many groups, or why not.
pub async fn node_groups_over(address: &str, tls: ClientTlsConfig) -> Result<usize, String> {
    let channel = connect_tls(address, tls).await?;
    node_groups_on(channel).await
}

/// NodeGroups on an existing channel.
pub async fn node_groups_on(channel: Channel) -> Result<usize, String> {
    use capi_autoscaler_provider::proto::NodeGroupsRequest;
    use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
    CloudProviderClient::new(channel)
        .node_groups(NodeGroupsRequest {})
        .await
        .map(|r| r.get_ref().node_groups.len())
        .map_err(|e| format!("NodeGroups: {e}"))
}
