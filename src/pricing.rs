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
    object: &str,
    annotations: &BTreeMap<String, String>,
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

impl ReferencePrices {
    /// CA's GCE price model list prices (USD per core-hour, per GiB-hour), used when nothing else is known.
    pub const FALLBACK: ReferencePrices = ReferencePrices {
        cpu_hour: 0.033174,
        gib_hour: 0.004446,
    };

    /// Reference prices from priced groups: `(hourly price, cpu cores, memory GiB)` of one node of each.
    /// Half of each price goes to CPU and half to memory; the result is the median per core and the median
    /// per GiB (the mean of the middle two for an even count). Entries without a finite non-negative price or
    /// without positive finite CPU and memory are skipped; `None` when none is left. See the module doc.
    pub fn derive(priced: &[(f64, f64, f64)]) -> Option<ReferencePrices> {
        let mut per_core = Vec::new();
        let mut per_gib = Vec::new();
        for &(price, cores, gib) in priced {
            let usable = price.is_finite()
                && price >= 0.0
                && cores.is_finite()
                && cores > 0.0
                && gib.is_finite()
                && gib > 0.0;
            if usable {
                per_core.push(price / 2.0 / cores);
                per_gib.push(price / 2.0 / gib);
            }
        }
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
        priced: &[(f64, f64, f64)],
    ) -> (ReferencePrices, [PriceSource; 2]) {
        let valid = |f: Option<f64>| f.filter(|v| v.is_finite() && *v >= 0.0);
        let derived = Self::derive(priced);
        let used = priced
            .iter()
            .filter(|(p, c, m)| {
                p.is_finite() && *p >= 0.0 && c.is_finite() && *c > 0.0 && m.is_finite() && *m > 0.0
            })
            .count();
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

/// `pod_bytes` of `PricingPodPriceRequest`: the raw `k8s.io.api.core.v1.Pod` message (Go's `Pod.Marshal()`).
pub fn decode_pod(bytes: &[u8]) -> Result<Pod, String> {
    Pod::decode(bytes).map_err(|e| format!("pod_bytes is not a v1.Pod: {e}"))
}

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 { v } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_pb::api::core::v1::{PodSpec, ResourceRequirements};
    use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    const OBJ: &str = "MachineDeployment default/md-0";

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn group_prices() {
        type Case<'a> = (Option<&'a str>, Result<Option<f64>, &'a str>);
        let cases: &[Case] = &[
            (None, Ok(None)),
            (Some("0.096"), Ok(Some(0.096))),
            (Some("12"), Ok(Some(12.0))),
            (Some(" 1.5 "), Ok(Some(1.5))),
            (Some(".5"), Ok(Some(0.5))),
            (Some("3."), Ok(Some(3.0))),
            (Some("0"), Ok(Some(0.0))),
            (Some(""), Err("empty")),
            (Some("-1"), Err("negative")),
            (Some("1e3"), Err("decimal")),
            (Some("inf"), Err("decimal")),
            (Some("NaN"), Err("decimal")),
            (Some("$1"), Err("decimal")),
            (Some("1,5"), Err("decimal")),
            (Some("."), Err("decimal")),
            (Some("+1"), Err("decimal")),
            (Some("1.2.3"), Err("decimal")),
        ];
        for (value, want) in cases {
            let mut a = BTreeMap::new();
            a.insert("other".to_string(), "x".to_string());
            if let Some(v) = value {
                a.insert(PRICE_ANNOTATION.to_string(), v.to_string());
            }
            match (group_price(OBJ, &a), want) {
                (Ok(got), Ok(w)) => assert_eq!(got, *w, "{value:?}"),
                (Err(p), Err(fragment)) => {
                    assert_eq!(p.object, OBJ);
                    assert_eq!(
                        p.field,
                        "metadata.annotations[capi-autoscaler-provider/hourly-price]"
                    );
                    assert!(p.message.contains(fragment), "{value:?}: {}", p.message);
                }
                (got, w) => panic!("{value:?}: got {got:?}, want {w:?}"),
            }
        }
    }

    #[test]
    fn node_prices() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let cases = [
            (2.0, 0u64, 3600u64, 2.0),
            (2.0, 0, 1800, 1.0),
            (0.096, 0, 36_000, 0.96),
            (2.0, 3600, 0, 0.0), // end before start
            (2.0, 100, 100, 0.0),
            (0.0, 0, 3600, 0.0),
        ];
        for (hourly, s, e, want) in cases {
            let got = node_price(
                hourly,
                t0 + Duration::from_secs(s),
                t0 + Duration::from_secs(e),
            );
            assert!(close(got, want), "{hourly} {s}..{e}: {got} != {want}");
        }
    }

    #[test]
    fn timestamps() {
        assert_eq!(timestamp(0, 0), Some(UNIX_EPOCH));
        assert_eq!(timestamp(10, 5), Some(UNIX_EPOCH + Duration::new(10, 5)));
        assert_eq!(
            timestamp(-10, 500_000_000),
            UNIX_EPOCH.checked_sub(Duration::from_millis(9_500))
        );
        assert_eq!(timestamp(1, -1), None);
        assert_eq!(timestamp(1, 1_000_000_000), None);
        // out of SystemTime's range on any platform: no panic, whatever the answer
        let _ = timestamp(i64::MAX, 999_999_999);
        let _ = timestamp(i64::MIN, 0);
        let a = timestamp(1_700_000_000, 0).unwrap_or(UNIX_EPOCH);
        let b = timestamp(1_700_003_600, 0).unwrap_or(UNIX_EPOCH);
        assert!(close(hours_between(a, b), 1.0));
        assert_eq!(hours_between(b, a), 0.0);
    }

    #[test]
    fn derive_reference_prices() {
        // one group: 4 cores, 16 GiB, 0.2/h → 0.1/4 per core, 0.1/16 per GiB
        let r = ReferencePrices::derive(&[(0.2, 4.0, 16.0)]);
        assert_eq!(
            r,
            Some(ReferencePrices {
                cpu_hour: 0.025,
                gib_hour: 0.00625
            })
        );
        // a node of that group filled by pods costs the node's price
        let r = r.unwrap_or(ReferencePrices::FALLBACK);
        assert!(close(4.0 * r.cpu_hour + 16.0 * r.gib_hour, 0.2));

        // median over three, the GPU outlier does not move it
        let r = ReferencePrices::derive(&[(0.2, 4.0, 16.0), (0.4, 8.0, 32.0), (10.0, 4.0, 16.0)]);
        assert_eq!(
            r,
            Some(ReferencePrices {
                cpu_hour: 0.025,
                gib_hour: 0.00625
            })
        );
        // even count: mean of the middle two
        let r = ReferencePrices::derive(&[(0.2, 4.0, 16.0), (0.6, 4.0, 16.0)]);
        let r = r.unwrap_or(ReferencePrices::FALLBACK);
        assert!(
            close(r.cpu_hour, 0.05) && close(r.gib_hour, 0.0125),
            "{r:?}"
        );
        // unusable entries skipped
        assert_eq!(ReferencePrices::derive(&[]), None);
        assert_eq!(
            ReferencePrices::derive(&[
                (0.2, 0.0, 16.0),
                (0.2, 4.0, 0.0),
                (f64::NAN, 4.0, 16.0),
                (-1.0, 4.0, 16.0),
                (0.2, f64::INFINITY, 16.0)
            ]),
            None
        );
    }

    #[test]
    fn resolve_reference_prices() {
        let priced = [(0.2, 4.0, 16.0)];
        let (r, src) = ReferencePrices::resolve(None, None, &priced);
        assert_eq!(
            r,
            ReferencePrices {
                cpu_hour: 0.025,
                gib_hour: 0.00625
            }
        );
        assert_eq!(src, [PriceSource::Derived(1), PriceSource::Derived(1)]);
        let (r, src) = ReferencePrices::resolve(Some(0.04), None, &priced);
        assert_eq!(
            r,
            ReferencePrices {
                cpu_hour: 0.04,
                gib_hour: 0.00625
            }
        );
        assert_eq!(src, [PriceSource::Flag, PriceSource::Derived(1)]);
        let (r, src) = ReferencePrices::resolve(Some(0.04), Some(0.005), &[]);
        assert_eq!(
            r,
            ReferencePrices {
                cpu_hour: 0.04,
                gib_hour: 0.005
            }
        );
        assert_eq!(src, [PriceSource::Flag, PriceSource::Flag]);
        let (r, src) = ReferencePrices::resolve(None, Some(f64::NAN), &[]);
        assert_eq!(r, ReferencePrices::FALLBACK);
        assert_eq!(src, [PriceSource::Fallback, PriceSource::Fallback]);
    }

    fn q(s: &str) -> Quantity {
        Quantity {
            string: Some(s.to_string()),
        }
    }

    fn container(cpu: Option<&str>, mem: Option<&str>, restart: Option<&str>) -> Container {
        let mut requests = BTreeMap::new();
        if let Some(c) = cpu {
            requests.insert("cpu".to_string(), q(c));
        }
        if let Some(m) = mem {
            requests.insert("memory".to_string(), q(m));
        }
        Container {
            name: Some("c".to_string()),
            resources: Some(ResourceRequirements {
                requests,
                ..Default::default()
            }),
            restart_policy: restart.map(str::to_string),
            ..Default::default()
        }
    }

    fn pod(containers: Vec<Container>, init: Vec<Container>, overhead: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: Some(ObjectMeta {
                name: Some("p".to_string()),
                namespace: Some("default".to_string()),
                ..Default::default()
            }),
            spec: Some(PodSpec {
                containers,
                init_containers: init,
                overhead: overhead
                    .iter()
                    .map(|(k, v)| (k.to_string(), q(v)))
                    .collect(),
                ..Default::default()
            }),
            status: None,
        }
    }

    #[test]
    fn requests_and_prices() {
        let refs = ReferencePrices {
            cpu_hour: 0.04,
            gib_hour: 0.005,
        };
        // (name, pod, cpu cores, memory GiB)
        let cases = vec![
            ("empty pod", Pod::default(), 0.0, 0.0),
            (
                "no requests",
                pod(vec![container(None, None, None)], vec![], &[]),
                0.0,
                0.0,
            ),
            (
                "containers summed",
                pod(
                    vec![
                        container(Some("500m"), Some("1Gi"), None),
                        container(Some("1500m"), Some("512Mi"), None),
                    ],
                    vec![],
                    &[],
                ),
                2.0,
                1.5,
            ),
            (
                "init container larger than containers",
                pod(
                    vec![container(Some("1"), Some("1Gi"), None)],
                    vec![
                        container(Some("3"), Some("256Mi"), None),
                        container(Some("2"), Some("2Gi"), None),
                    ],
                    &[],
                ),
                3.0,
                2.0,
            ),
            (
                "sidecar adds to containers and to later init containers",
                pod(
                    vec![container(Some("1"), Some("1Gi"), None)],
                    vec![
                        container(Some("500m"), Some("512Mi"), Some("Always")),
                        container(Some("2"), Some("1Gi"), None),
                    ],
                    &[],
                ),
                // init peak: 2 + 0.5 = 2.5 cores, 1 + 0.5 GiB; running: 1 + 0.5 cores, 1.5 GiB
                2.5,
                1.5,
            ),
            (
                "init container before a sidecar does not see it",
                pod(
                    vec![container(Some("1"), Some("1Gi"), None)],
                    vec![
                        container(Some("2"), Some("1Gi"), None),
                        container(Some("500m"), Some("512Mi"), Some("Always")),
                    ],
                    &[],
                ),
                2.0,
                1.5,
            ),
            (
                "overhead added",
                pod(
                    vec![container(Some("1"), Some("1Gi"), None)],
                    vec![],
                    &[("cpu", "250m"), ("memory", "256Mi")],
                ),
                1.25,
                1.25,
            ),
            (
                "malformed quantity counts 0",
                pod(
                    vec![container(Some("lots"), Some("2Gi"), None)],
                    vec![],
                    &[],
                ),
                0.0,
                2.0,
            ),
        ];
        for (name, p, cpu, gib) in cases {
            let r = pod_requests(&p);
            assert!(
                close(r.cpu_cores, cpu),
                "{name}: cpu {} != {cpu}",
                r.cpu_cores
            );
            assert!(
                close(r.memory_gib, gib),
                "{name}: memory {} != {gib}",
                r.memory_gib
            );
            let want = (cpu * 0.04 + gib * 0.005) * 2.0;
            let got = pod_price(&p, &refs, 2.0);
            assert!(close(got, want), "{name}: price {got} != {want}");
            assert_eq!(pod_price(&p, &refs, 0.0), 0.0, "{name}");
            assert_eq!(pod_price(&p, &refs, -1.0), 0.0, "{name}");
        }
    }

    #[test]
    fn pod_level_resources_replace_container_sum() {
        let mut p = pod(
            vec![container(Some("1"), Some("1Gi"), None)],
            vec![],
            &[("cpu", "100m")],
        );
        if let Some(spec) = p.spec.as_mut() {
            let mut requests = BTreeMap::new();
            requests.insert("cpu".to_string(), q("4"));
            spec.resources = Some(ResourceRequirements {
                requests,
                ..Default::default()
            });
        }
        let r = pod_requests(&p);
        assert!(close(r.cpu_cores, 4.1), "{r:?}");
        assert!(close(r.memory_gib, 1.0), "{r:?}");
    }

    #[test]
    fn decode_round_trip() {
        let p = pod(
            vec![container(Some("250m"), Some("64Mi"), None)],
            vec![container(Some("1"), None, Some("Always"))],
            &[("memory", "10Mi")],
        );
        let bytes = p.encode_to_vec();
        let decoded = decode_pod(&bytes);
        assert_eq!(decoded.as_ref().ok(), Some(&p));
        let r = decoded.map(|p| pod_requests(&p)).unwrap_or_default();
        assert!(
            close(r.cpu_cores, 1.25) && close(r.memory_gib, 74.0 / 1024.0),
            "{r:?}"
        );
        assert_eq!(decode_pod(&[]), Ok(Pod::default()));
        assert!(decode_pod(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode_pod(b"k8s\x00garbage").is_err());
    }
}
