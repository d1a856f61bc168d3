//! Flags and environment → one `Config` value. Flag names follow the in-tree provider and CA where they exist.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::capi::names::is_dns1123_subdomain;
use crate::capi::{DEFAULT_GROUP, Keys};
use crate::discovery::DiscoverySpec;
use crate::scope::ClusterRef;

#[derive(Debug, Parser)]
#[command(
    name = "capi-autoscaler-provider",
    version = crate::version::LONG_VERSION,
    about = "cluster-autoscaler externalgrpc cloud provider for Cluster API",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `serve` is the default command.
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the externalgrpc CloudProvider service (the default).
    Serve(ServeArgs),
    /// Show what cluster-autoscaler will see: groups, bounds, templates, options, prices, problems.
    Check(CheckArgs),
    /// Print the scale-from-zero template Node of one node group as YAML.
    Template(TemplateArgs),
    /// Why cluster-autoscaler did or did not scale up for a pod: its Events and status next to the
    /// provider's view of the node groups.
    Explain(ExplainArgs),
}

/// Every flag of every command also reads an environment variable (`CAPI_AUTOSCALER_PROVIDER_*`, or the
/// in-tree provider's `CAPI_*` names), so `check` run inside the provider's container sees the
/// configuration `serve` was given there. `--kubeconfig` is deliberately not `KUBECONFIG`: that one names
/// the cluster a person works on, and here it would silently become the workload cluster.
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Kubeconfig of the management cluster (where the Cluster API objects are).
    #[arg(
        long = "cloud-config",
        env = "CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG",
        value_name = "PATH"
    )]
    pub cloud_config: Option<PathBuf>,
    /// Kubeconfig of the workload cluster (its Nodes label scale-from-zero templates).
    #[arg(long, env = "CAPI_AUTOSCALER_PROVIDER_KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Without --cloud-config, use the in-cluster config for the management cluster instead of --kubeconfig.
    #[arg(
        long = "clusterapi-cloud-config-authoritative",
        env = "CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG_AUTHORITATIVE",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub cloud_config_authoritative: bool,
    /// Which scalable resources are node groups: `clusterapi:namespace=NS,clusterName=NAME,LABEL=VALUE`.
    /// Repeatable; a resource is a node group when it matches any spec. None: every annotated resource.
    /// In the environment, specs are separated by `;` (a spec itself contains commas).
    #[arg(
        long = "node-group-auto-discovery",
        env = "CAPI_AUTOSCALER_PROVIDER_NODE_GROUP_AUTO_DISCOVERY",
        value_name = "SPEC",
        value_delimiter = ';'
    )]
    pub node_group_auto_discovery: Vec<String>,
    /// The Cluster whose Nodes cluster-autoscaler watches, `NAME` or `NAMESPACE/NAME`: only its node
    /// groups are served. Unset: the Cluster the workload cluster's Nodes name, else the one Cluster
    /// of every node group; when that is ambiguous nothing is served.
    #[arg(
        long,
        env = "CAPI_AUTOSCALER_PROVIDER_CLUSTER",
        value_name = "[NAMESPACE/]NAME"
    )]
    pub cluster: Option<String>,
    /// API group of the Cluster API objects; also the prefix of the group-dependent annotation keys.
    #[arg(long = "capi-group", env = "CAPI_GROUP", default_value = DEFAULT_GROUP, hide_env_values = true)]
    pub capi_group: String,
    /// API version of the Cluster API objects; discovered (the served preferred version) when empty.
    #[arg(long = "capi-version", env = "CAPI_VERSION")]
    pub capi_version: Option<String>,
    /// Architecture of scale-from-zero templates whose infrastructure template has no status.nodeInfo.
    #[arg(long = "scale-zero-default-arch", env = "CAPI_SCALE_ZERO_DEFAULT_ARCH")]
    pub scale_zero_default_arch: Option<String>,
    /// Reference price of one CPU core per hour for PricingPodPrice; derived from the priced groups when unset.
    #[arg(
        long = "pod-price-per-cpu-hour",
        env = "CAPI_AUTOSCALER_PROVIDER_POD_PRICE_PER_CPU_HOUR",
        value_name = "PRICE"
    )]
    pub cpu_hour_price: Option<f64>,
    /// Reference price of one GiB of memory per hour for PricingPodPrice; derived when unset.
    #[arg(
        long = "pod-price-per-gib-hour",
        env = "CAPI_AUTOSCALER_PROVIDER_POD_PRICE_PER_GIB_HOUR",
        value_name = "PRICE"
    )]
    pub gib_hour_price: Option<f64>,
    /// After this long without a frame from the API server on the HTTP/2 connection, ping it (as
    /// client-go does after 30 s).
    #[arg(
        long = "api-ping-interval",
        env = "CAPI_AUTOSCALER_PROVIDER_API_PING_INTERVAL",
        default_value = "30s",
        value_parser = parse_positive_duration
    )]
    pub api_ping_interval: std::time::Duration,
    /// A ping not answered within this closes the connection: its watches and writes move to a new one.
    #[arg(
        long = "api-ping-timeout",
        env = "CAPI_AUTOSCALER_PROVIDER_API_PING_TIMEOUT",
        default_value = "15s",
        value_parser = parse_positive_duration
    )]
    pub api_ping_timeout: std::time::Duration,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// gRPC listen address. The default is loopback: the provider runs as a sidecar of cluster-autoscaler.
    #[arg(
        long,
        env = "CAPI_AUTOSCALER_PROVIDER_ADDRESS",
        default_value = "127.0.0.1:8086"
    )]
    pub address: SocketAddr,
    /// HTTP address for /metrics, /healthz and /readyz; disabled when empty.
    #[arg(
        long = "metrics-address",
        env = "CAPI_AUTOSCALER_PROVIDER_METRICS_ADDRESS",
        default_value = "127.0.0.1:8087"
    )]
    pub metrics_address: Option<String>,
    /// PEM certificate of the gRPC server; with --tls-key the listener speaks TLS.
    #[arg(
        long = "tls-cert",
        env = "CAPI_AUTOSCALER_PROVIDER_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of the gRPC server.
    #[arg(
        long = "tls-key",
        env = "CAPI_AUTOSCALER_PROVIDER_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle; when given, clients must present a certificate it signed (mTLS).
    #[arg(
        long = "tls-client-ca",
        env = "CAPI_AUTOSCALER_PROVIDER_TLS_CLIENT_CA",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the scale RPCs (which change replicas and mark Machines for deletion) on an address other
    /// than loopback without TLS client authentication. Off: such a start is refused, since anyone who
    /// reaches the address could then delete the cluster's Machines.
    #[arg(
        long = "allow-unauthenticated-writes",
        env = "CAPI_AUTOSCALER_PROVIDER_ALLOW_UNAUTHENTICATED_WRITES",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub allow_unauthenticated_writes: bool,
    /// How often delete marks left without their replica decrement are looked for and taken back.
    #[arg(
        long = "repair-interval",
        env = "CAPI_AUTOSCALER_PROVIDER_REPAIR_INTERVAL",
        default_value = "30s",
        value_parser = parse_duration
    )]
    pub repair_interval: std::time::Duration,
    /// How old a record must be before the repair takes it back: a removal's claim or mark that no
    /// removal settles (its removal stopped part-way), a pool entry whose instance left the list
    /// (CA may still retry it). Longer than a removal may still mark in (`--request-timeout` plus
    /// 4 s; shorter is warned of). Counted on the API server's clock (the `Date` of its answers)
    /// from the record's stamp, its removal's start on that clock; a pool entry has no stamp and
    /// waits from when this provider first saw it unlisted. What Cluster API has done is not timed:
    /// an absorbed mark is taken back, and capacity without a Machine cancelled, once Cluster API
    /// has observed the group's replicas (observedGeneration, its MachineSets' replicas).
    #[arg(
        long = "mark-grace-period",
        env = "CAPI_AUTOSCALER_PROVIDER_MARK_GRACE_PERIOD",
        default_value = "30s",
        value_parser = parse_duration
    )]
    pub mark_grace_period: std::time::Duration,
    /// Largest gRPC request read, in bytes (`Ki`, `Mi`, `Gi` suffixes allowed); a larger one is refused
    /// with RESOURCE_EXHAUSTED. CA's largest requests are DeleteNodes (every node with its labels and
    /// annotations) and PricingPodPrice (a whole pod).
    #[arg(
        long = "max-message-size",
        env = "CAPI_AUTOSCALER_PROVIDER_MAX_MESSAGE_SIZE",
        default_value = "16Mi",
        value_name = "BYTES",
        value_parser = parse_size
    )]
    pub max_message_size: usize,
    /// CloudProvider calls handled at the same time; more wait for their turn (within --request-timeout),
    /// then are answered UNAVAILABLE.
    #[arg(
        long = "max-concurrent-requests",
        env = "CAPI_AUTOSCALER_PROVIDER_MAX_CONCURRENT_REQUESTS",
        default_value = "64",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_concurrent_requests: u32,
    /// Longest a CloudProvider call is worked on before it is answered DEADLINE_EXCEEDED; below CA's own
    /// gRPC timeout (5 s unless its cloud-config says otherwise). An accepted scale operation still runs
    /// to completion.
    #[arg(
        long = "request-timeout",
        env = "CAPI_AUTOSCALER_PROVIDER_REQUEST_TIMEOUT",
        default_value = "4s",
        value_parser = parse_positive_duration
    )]
    pub request_timeout: std::time::Duration,
    /// How long a watch may keep failing before the provider stops saying it is ready: gRPC health
    /// NOT_SERVING, /readyz 503 with the reason, scale writes refused with UNAVAILABLE. Forbidden (403)
    /// and not found (404) count at once.
    #[arg(
        long = "watch-stale-after",
        env = "CAPI_AUTOSCALER_PROVIDER_WATCH_STALE_AFTER",
        default_value = "60s",
        value_parser = parse_positive_duration
    )]
    pub watch_stale_after: std::time::Duration,
    /// Server-side timeout of each watch request (1s to 290s): watches are re-established at least this
    /// often, so a permission taken away meanwhile is noticed within it.
    #[arg(
        long = "watch-timeout",
        env = "CAPI_AUTOSCALER_PROVIDER_WATCH_TIMEOUT",
        default_value = "60s",
        value_parser = parse_watch_timeout
    )]
    pub watch_timeout: std::time::Duration,
}

impl ServeArgs {
    /// Who can reach the scale RPCs: loopback (the sidecar), clients with a certificate the
    /// `--tls-client-ca` bundle signed, or anyone only when `--allow-unauthenticated-writes` says so.
    pub fn check_write_exposure(&self) -> Result<(), String> {
        if self.address.ip().is_loopback()
            || self.tls_client_ca.is_some()
            || self.allow_unauthenticated_writes
        {
            return Ok(());
        }
        let transport = if self.tls_cert.is_some() {
            "TLS without client certificates"
        } else {
            "plaintext"
        };
        Err(format!(
            "--address {}: refusing to serve the scale RPCs (IncreaseSize, DeleteNodes, DecreaseTargetSize) on a non-loopback address over {transport}: anyone who reaches it could change replicas and delete Machines. Listen on 127.0.0.1 (the sidecar), require client certificates with --tls-client-ca (mTLS), or pass --allow-unauthenticated-writes if something else guards the address",
            self.address
        ))
    }
}

/// A Go-style duration (`30s`, `1m30s`), not negative.
fn parse_duration(value: &str) -> Result<std::time::Duration, String> {
    let nanos = crate::options::parse_go_duration(value).map_err(|e| e.to_string())?;
    u64::try_from(nanos)
        .map(std::time::Duration::from_nanos)
        .map_err(|_| format!("{value:?} is negative"))
}

fn parse_positive_duration(value: &str) -> Result<std::time::Duration, String> {
    match parse_duration(value)? {
        d if d.is_zero() => Err(format!("{value:?} must be longer than zero")),
        d => Ok(d),
    }
}

/// Whole seconds from 1 to 290: the API server's watch timeout (kube's client waits 5 s longer, and
/// its requests end at 295 s).
fn parse_watch_timeout(value: &str) -> Result<std::time::Duration, String> {
    let d = parse_duration(value)?;
    if d < std::time::Duration::from_secs(1) || d > std::time::Duration::from_secs(290) {
        return Err(format!("{value:?} is not between 1s and 290s"));
    }
    Ok(std::time::Duration::from_secs(d.as_secs()))
}

/// A byte count: digits, optionally followed by `Ki`, `Mi` or `Gi`; more than zero.
fn parse_size(value: &str) -> Result<usize, String> {
    let (digits, unit) = match value.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => value.split_at(i),
        None => (value, ""),
    };
    let shift = match unit {
        "" => 0,
        "Ki" => 10,
        "Mi" => 20,
        "Gi" => 30,
        _ => return Err(format!("{value:?}: the unit must be Ki, Mi or Gi")),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{value:?} is not a byte count such as 16Mi"))?;
    let bytes = n
        .checked_mul(1usize << shift)
        .ok_or_else(|| format!("{value:?} is too large"))?;
    if bytes == 0 {
        return Err(format!("{value:?} must be more than zero"));
    }
    Ok(bytes)
}

/// Where `check` and `explain` find the running provider: its HTTP address (`serve`'s
/// `--metrics-address`, the same variable, so in the provider's container it is the one `serve`
/// listens on). Asked first, so that a command run in the pod does not build a second cache; when
/// nothing answers there, or a provider of another configuration does, the command reads the
/// cluster itself. Empty: always read the cluster itself.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    #[arg(
        long = "metrics-address",
        env = "CAPI_AUTOSCALER_PROVIDER_METRICS_ADDRESS",
        default_value = "127.0.0.1:8087"
    )]
    pub metrics_address: String,
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    /// The pod, `NAMESPACE/NAME`, in the cluster cluster-autoscaler watches (`--kubeconfig`, else the
    /// management cluster).
    #[arg(value_name = "NAMESPACE/POD")]
    pub pod: String,
    /// Namespace of cluster-autoscaler's status ConfigMap (CA's `--namespace`).
    #[arg(
        long = "autoscaler-namespace",
        env = "CAPI_AUTOSCALER_PROVIDER_AUTOSCALER_NAMESPACE",
        default_value = "kube-system"
    )]
    pub autoscaler_namespace: String,
    /// Name of cluster-autoscaler's status ConfigMap (CA's `--status-config-map-name`).
    #[arg(
        long = "status-config-map",
        env = "CAPI_AUTOSCALER_PROVIDER_STATUS_CONFIG_MAP",
        default_value = "cluster-autoscaler-status"
    )]
    pub status_config_map: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct TemplateArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Node group id, e.g. `MachineDeployment/default/md-0`.
    pub id: String,
}

/// `-o`/`--output` of `check` and `explain`.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Output format.
    #[arg(
        short = 'o',
        long = "output",
        env = "CAPI_AUTOSCALER_PROVIDER_OUTPUT",
        value_enum,
        default_value = "table"
    )]
    pub format: OutputFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// Where a kubeconfig comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeconfigSource {
    File(PathBuf),
    /// The pod's service account, or whatever `kube::Config::infer` finds.
    Inferred,
}

/// Everything the provider needs to know, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub management: KubeconfigSource,
    pub workload: Option<PathBuf>,
    pub discovery: Vec<DiscoverySpec>,
    pub cluster: Option<ClusterRef>,
    pub keys: Keys,
    pub capi_version: Option<String>,
    pub default_arch: Option<String>,
    pub cpu_hour_price: Option<f64>,
    pub gib_hour_price: Option<f64>,
    pub api_ping: ApiPing,
}

/// The health check of the HTTP/2 connection to an API server (`startup::client`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiPing {
    /// Without a frame from the server this long, a ping.
    pub interval: std::time::Duration,
    /// No answer to it within this: the connection is closed.
    pub timeout: std::time::Duration,
}

impl Default for ApiPing {
    /// client-go's: HTTP2_READ_IDLE_TIMEOUT_SECONDS 30, HTTP2_PING_TIMEOUT_SECONDS 15.
    fn default() -> Self {
        ApiPing {
            interval: std::time::Duration::from_secs(30),
            timeout: std::time::Duration::from_secs(15),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("--node-group-auto-discovery {spec:?}: {reason}")]
    Discovery { spec: String, reason: String },
    #[error("--cluster (CAPI_AUTOSCALER_PROVIDER_CLUSTER): {0}")]
    Cluster(String),
    #[error("CAPI_GROUP {0:?} is not a DNS subdomain")]
    Group(String),
    #[error("{flag} {value}: must be a finite, non-negative number")]
    Price { flag: &'static str, value: f64 },
}

impl ConnectionArgs {
    pub fn config(&self) -> Result<Config, ConfigError> {
        let discovery = self
            .node_group_auto_discovery
            .iter()
            .map(|spec| {
                spec.parse::<DiscoverySpec>()
                    .map_err(|e| ConfigError::Discovery {
                        spec: spec.clone(),
                        reason: e.reason,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let cluster = self
            .cluster
            .as_deref()
            .filter(|c| !c.is_empty())
            .map(str::parse::<ClusterRef>)
            .transpose()
            .map_err(ConfigError::Cluster)?;
        let group = if self.capi_group.is_empty() {
            DEFAULT_GROUP.to_string()
        } else {
            self.capi_group.clone()
        };
        if !is_dns1123_subdomain(&group) {
            return Err(ConfigError::Group(group));
        }
        for (flag, value) in [
            ("--pod-price-per-cpu-hour", self.cpu_hour_price),
            ("--pod-price-per-gib-hour", self.gib_hour_price),
        ] {
            if let Some(value) = value
                && !(value.is_finite() && value >= 0.0)
            {
                return Err(ConfigError::Price { flag, value });
            }
        }
        // As upstream: the management cluster is --cloud-config; without it, --kubeconfig unless the
        // cloud config is authoritative, in which case the in-cluster config.
        let management = match (&self.cloud_config, &self.kubeconfig) {
            (Some(path), _) => KubeconfigSource::File(path.clone()),
            (None, Some(path)) if !self.cloud_config_authoritative => {
                KubeconfigSource::File(path.clone())
            }
            _ => KubeconfigSource::Inferred,
        };
        Ok(Config {
            management,
            workload: self.kubeconfig.clone(),
            discovery,
            cluster,
            keys: Keys::new(&group),
            capi_version: self.capi_version.clone().filter(|v| !v.is_empty()),
            default_arch: self
                .scale_zero_default_arch
                .clone()
                .filter(|v| !v.is_empty()),
            cpu_hour_price: self.cpu_hour_price,
            gib_hour_price: self.gib_hour_price,
            api_ping: ApiPing {
                interval: self.api_ping_interval,
                timeout: self.api_ping_timeout,
            },
        })
    }
}

#[cfg(test)]
mod tests;
