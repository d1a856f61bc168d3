//! Prices for CA's `price` expander, pure.
//!
//! A group is priced by the annotation `capi-autoscaler-provider/hourly-price` (any currency, per node and
//! hour). `PricingNodePrice` = that price × the hours asked about. `PricingPodPrice` must answer for every
//! pod once any group is priced (CA drops an expansion option when a pod price fails), so pods are priced
//! from their requests at reference prices per CPU-hour and per GiB-hour.
//!
//! # Reference prices
//! Flags give them; a price not given by a flag is derived from the priced groups ([`ReferencePrices::derive`]):
//! each group's hourly price is split half to its CPUs and half to its memory, giving a per-core and a per-GiB
//! price per group; the reference is the median of each over the groups.
//! - Half and half, because one price per group cannot separate what CPU and memory cost (one equation, two
//!   unknowns; solving across groups is ill-conditioned when shapes are similar and can go negative). With the
//!   split, a pod that fills a node of a typical group at its CPU and memory costs about that node's price, so
//!   the expander's node-price / pod-price ratio stays near 1 for well-packed options and grows with waste,
//!   whatever the currency.
//! - The median, because it ignores outliers: one GPU group priced 20× the others does not make every pod's
//!   CPU expensive (callers should leave GPU groups out when CPU-only groups are priced).
//! - When nothing can be derived (no priced group with a known CPU and memory capacity), the fallback is
//!   [`ReferencePrices::FALLBACK`], the on-demand list prices CA's own GCE price model uses: never zero, so
//!   CA's ratios stay finite.

use crate::capi::Labels;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_pb::api::core::v1::{Container, Pod};
use k8s_pb::apimachinery::pkg::api::resource::Quantity;
use prost::Message;

use crate::capi::PRICE_ANNOTATION;
use crate::problem::Problem;

const SECONDS_PER_HOUR: f64 = 3600.0;
const BYTES_PER_GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The hourly price of one node of a group, from [`PRICE_ANNOTATION`]: `Ok(None)` when absent, a problem when
/// it is not a finite non-negative decimal (`12`, `0.096`, `.5`; no sign, exponent, `inf` or `nan`).
pub fn group_price(
    object: impl Into<crate::problem::Subject> + Copy,
    annotations: &Labels,
) -> Result<Option<f64>, Problem> {
    let Some(raw) = annotations.get(PRICE_ANNOTATION) else {
        return Ok(None);
    };
    let bad = |message: &str| {
        Problem::new(
            object,
            Problem::annotation_field(PRICE_ANNOTATION),
            format!("{message} (value {raw:?}); the group has no price"),
        )
    };
    let value = raw.trim();
    if value.is_empty() {
        return Err(bad("empty price"));
    }
    if value.starts_with('-') {
        return Err(bad("a price cannot be negative"));
    }
    if !is_plain_decimal(value) {
        return Err(bad(
            "not a decimal number of currency units per node-hour, e.g. 0.096",
        ));
    }
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(Some(v)),
        _ => Err(bad("not a finite decimal number")),
    }
}

/// `[0-9]+(\.[0-9]*)?` or `\.[0-9]+`.
fn is_plain_decimal(s: &str) -> bool {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    digits(int)
        && frac.is_none_or(digits)
        && (!int.is_empty() || frac.is_some_and(|f| !f.is_empty()))
}

/// A protobuf `Timestamp` (seconds and nanos since the Unix epoch, either side of it) as a `SystemTime`;
/// `None` when it is out of range or malformed.
pub fn timestamp(seconds: i64, nanos: i32) -> Option<SystemTime> {
    if !(0..1_000_000_000).contains(&nanos) {
        return None;
    }
    let nanos = Duration::from_nanos(u64::try_from(nanos).ok()?);
    if seconds >= 0 {
        UNIX_EPOCH
            .checked_add(Duration::from_secs(seconds.unsigned_abs()))?
            .checked_add(nanos)
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(seconds.unsigned_abs()))?
            .checked_add(nanos)
    }
}

/// Hours from `start` to `end`; 0 when `end` is not after `start`.
pub fn hours_between(start: SystemTime, end: SystemTime) -> f64 {
    end.duration_since(start)
        .map(|d| d.as_secs_f64() / SECONDS_PER_HOUR)
        .unwrap_or(0.0)
}

/// The price of one node of a group priced `hourly` over [start, end]: 0 when `end` ≤ `start`.
pub fn node_price(hourly: f64, start: SystemTime, end: SystemTime) -> f64 {
    finite_or_zero(hourly * hours_between(start, end))
}

/// Prices per CPU-hour (one core) and per GiB-hour of memory requested.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct ReferencePrices {
    pub cpu_hour: f64,
    pub gib_hour: f64,
}

/// Where each reference price came from, for `check`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum PriceSource {
    Flag,
    /// Derived from this many priced groups.
    Derived(usize),
    Fallback,
}

/// One node of a priced group, as reference prices are derived from it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PricedNode {
    /// The group's price per node-hour.
    pub hourly: f64,
    pub cpu_cores: f64,
    pub memory_gib: f64,
    /// Nodes with GPUs cost more than their CPU and memory.
    pub gpu: bool,
}

impl PricedNode {
    fn usable(&self) -> bool {
        self.hourly.is_finite()
            && self.hourly >= 0.0
            && self.cpu_cores.is_finite()
            && self.cpu_cores > 0.0
            && self.memory_gib.is_finite()
            && self.memory_gib > 0.0
    }
}

impl ReferencePrices {
    /// CA's GCE price model list prices (USD per core-hour, per GiB-hour), used when nothing else is known.
    pub const FALLBACK: ReferencePrices = ReferencePrices {
        cpu_hour: 0.033174,
        gib_hour: 0.004446,
    };

    /// Reference prices from one node of each priced group. Half of each price goes to CPU and half
    /// to memory; the result is the median per core and the median per GiB (the mean of the middle
    /// two for an even count). GPU nodes cost more than their CPU and memory: they count only when
    /// no node without GPUs is priced. Entries without a finite non-negative price or without
    /// positive finite CPU and memory are skipped; `None` when none is left. See the module doc.
    pub fn derive(priced: &[PricedNode]) -> Option<ReferencePrices> {
        let (mut per_core, mut per_gib): (Vec<f64>, Vec<f64>) = counted(priced)
            .iter()
            .map(|n| (n.hourly / 2.0 / n.cpu_cores, n.hourly / 2.0 / n.memory_gib))
            .unzip();
        Some(ReferencePrices {
            cpu_hour: median(&mut per_core)?,
            gib_hour: median(&mut per_gib)?,
        })
    }

    /// Flags first, each price separately; what no flag gives is derived from `priced`, else the fallback.
    /// A flag that is negative or not finite counts as not given (config should reject it earlier).
    pub fn resolve(
        cpu_flag: Option<f64>,
        gib_flag: Option<f64>,
        priced: &[PricedNode],
    ) -> (ReferencePrices, [PriceSource; 2]) {
        let valid = |f: Option<f64>| f.filter(|v| v.is_finite() && *v >= 0.0);
        let derived = Self::derive(priced);
        let used = counted(priced).len();
        let pick = |flag: Option<f64>, from_derived: Option<f64>, fallback: f64| match (
            valid(flag),
            from_derived,
        ) {
            (Some(v), _) => (v, PriceSource::Flag),
            (None, Some(v)) => (v, PriceSource::Derived(used)),
            (None, None) => (fallback, PriceSource::Fallback),
        };
        let (cpu_hour, cpu_src) = pick(
            cpu_flag,
            derived.map(|d| d.cpu_hour),
            Self::FALLBACK.cpu_hour,
        );
        let (gib_hour, gib_src) = pick(
            gib_flag,
            derived.map(|d| d.gib_hour),
            Self::FALLBACK.gib_hour,
        );
        (ReferencePrices { cpu_hour, gib_hour }, [cpu_src, gib_src])
    }
}

/// The nodes reference prices come from: the usable ones, GPU nodes only when no other is priced.
fn counted(priced: &[PricedNode]) -> Vec<&PricedNode> {
    let usable: Vec<&PricedNode> = priced.iter().filter(|n| n.usable()).collect();
    if usable.iter().any(|n| !n.gpu) {
        usable.into_iter().filter(|n| !n.gpu).collect()
    } else {
        usable
    }
}

fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values.get(mid).copied()
    } else {
        Some((values.get(mid - 1)? + values.get(mid)?) / 2.0)
    }
}

/// What a pod requests, as the scheduler counts it: CPU in cores, memory in GiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PodRequests {
    pub cpu_cores: f64,
    pub memory_gib: f64,
}

impl PodRequests {
    fn add(self, o: PodRequests) -> PodRequests {
        PodRequests {
            cpu_cores: self.cpu_cores + o.cpu_cores,
            memory_gib: self.memory_gib + o.memory_gib,
        }
    }

    fn max(self, o: PodRequests) -> PodRequests {
        PodRequests {
            cpu_cores: self.cpu_cores.max(o.cpu_cores),
            memory_gib: self.memory_gib.max(o.memory_gib),
        }
    }
}

/// CPU cores and GiB in a resource list; values that do not parse count as 0 (the API server has
/// validated them already).
fn resources(list: &BTreeMap<String, Quantity>) -> PodRequests {
    let value = |name: &str| {
        list.get(name)
            .and_then(|q| q.string.as_deref())
            .and_then(|s| crate::capi::quantity::parse_quantity(s).ok())
            .filter(|v| *v > 0.0)
            .unwrap_or(0.0)
    };
    PodRequests {
        cpu_cores: value("cpu"),
        memory_gib: value("memory") / BYTES_PER_GIB,
    }
}

fn container_requests(c: &Container) -> PodRequests {
    c.resources
        .as_ref()
        .map(|r| resources(&r.requests))
        .unwrap_or_default()
}

/// The pod's effective requests as Kubernetes computes them (`resourcehelper.PodRequests`): containers
/// summed; init containers in order, each a peak of its own requests plus the restartable (sidecar, restart
/// policy `Always`) init containers started before it; sidecars also run beside the containers, so they add
/// to the sum; the result is the larger of the two; pod-level `spec.resources.requests` (PodLevelResources)
/// replace that per resource when set; `spec.overhead` is added.
pub fn pod_requests(pod: &Pod) -> PodRequests {
    let Some(spec) = pod.spec.as_ref() else {
        return PodRequests::default();
    };
    let mut sum = spec
        .containers
        .iter()
        .map(container_requests)
        .fold(PodRequests::default(), PodRequests::add);
    let mut sidecars = PodRequests::default();
    let mut init_peak = PodRequests::default();
    for c in &spec.init_containers {
        let own = container_requests(c);
        let peak = if c.restart_policy.as_deref() == Some("Always") {
            sum = sum.add(own);
            sidecars = sidecars.add(own);
            sidecars
        } else {
            own.add(sidecars)
        };
        init_peak = init_peak.max(peak);
    }
    let mut requests = sum.max(init_peak);
    if let Some(pod_level) = spec.resources.as_ref() {
        let has = |name: &str| pod_level.requests.contains_key(name);
        let level = resources(&pod_level.requests);
        if has("cpu") {
            requests.cpu_cores = level.cpu_cores;
        }
        if has("memory") {
            requests.memory_gib = level.memory_gib;
        }
    }
    requests.add(resources(&spec.overhead))
}

/// The price of a pod over `hours`: its requests at the reference prices. A pod without requests costs 0.
pub fn pod_price(pod: &Pod, refs: &ReferencePrices, hours: f64) -> f64 {
    if !(hours.is_finite() && hours > 0.0) {
        return 0.0;
    }
    let r = pod_requests(pod);
    finite_or_zero((r.cpu_cores * refs.cpu_hour + r.memory_gib * refs.gib_hour) * hours)
}

/// `pod_bytes` that do not decode as a `k8s.io.api.core.v1.Pod`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pod_bytes is not a v1.Pod: {0}")]
pub struct NotAPod(#[from] prost::DecodeError);

/// `pod_bytes` of `PricingPodPriceRequest`: the raw `k8s.io.api.core.v1.Pod` message (Go's `Pod.Marshal()`).
pub fn decode_pod(bytes: &[u8]) -> Result<Pod, NotAPod> {
    Ok(Pod::decode(bytes)?)
}

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 { v } else { 0.0 }
}

#[cfg(test)]
mod tests;
