//! Per-group autoscaling options from `<CAPI_GROUP>/autoscaling-options-<suffix>` annotations, pure.
//!
//! Key-compatible with the in-tree provider (same prefix, same lowercase suffixes, values lowercased before
//! parsing), and stricter where it helps: unknown suffixes, empty values, out-of-range thresholds, negative
//! durations and a zero `maxnodeprovisiontime` are reported as problems instead of being silently kept or
//! applied. A bad value leaves its field `None`, so CA's default applies to it.
//!
//! Over externalgrpc an options answer replaces *all* of CA's per-group options (fields the proto lacks, such
//! as MaxNodeStartupTime, become zero), so [`parse`] returns `None` unless at least one option parsed: the
//! service then answers the empty response and CA keeps its defaults. See DESIGN.md invariant 5.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::capi::Keys;
use crate::problem::Problem;

/// The option suffixes this provider understands (the text after `<group>/autoscaling-options-`).
pub mod suffix {
    pub const SCALE_DOWN_UTILIZATION_THRESHOLD: &str = "scaledownutilizationthreshold";
    pub const SCALE_DOWN_GPU_UTILIZATION_THRESHOLD: &str = "scaledowngpuutilizationthreshold";
    pub const SCALE_DOWN_UNNEEDED_TIME: &str = "scaledownunneededtime";
    pub const SCALE_DOWN_UNREADY_TIME: &str = "scaledownunreadytime";
    pub const MAX_NODE_PROVISION_TIME: &str = "maxnodeprovisiontime";
    pub const ZERO_OR_MAX_NODE_SCALING: &str = "zeroormaxnodescaling";
    pub const IGNORE_DAEMONSETS_UTILIZATION: &str = "ignoredaemonsetsutilization";
    /// Understood by the in-tree provider but not carried by the externalgrpc protocol.
    pub const MAX_NODE_STARTUP_TIME: &str = "maxnodestartuptime";

    pub const ALL: [&str; 7] = [
        SCALE_DOWN_UTILIZATION_THRESHOLD,
        SCALE_DOWN_GPU_UTILIZATION_THRESHOLD,
        SCALE_DOWN_UNNEEDED_TIME,
        SCALE_DOWN_UNREADY_TIME,
        MAX_NODE_PROVISION_TIME,
        ZERO_OR_MAX_NODE_SCALING,
        IGNORE_DAEMONSETS_UTILIZATION,
    ];
}

/// The options one group overrides; `None` = CA's default.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct GroupOptions {
    pub scale_down_utilization_threshold: Option<f64>,
    pub scale_down_gpu_utilization_threshold: Option<f64>,
    pub scale_down_unneeded_time: Option<Duration>,
    pub scale_down_unready_time: Option<Duration>,
    pub max_node_provision_time: Option<Duration>,
    pub zero_or_max_node_scaling: Option<bool>,
    pub ignore_daemonsets_utilization: Option<bool>,
}

/// What CA sends as `defaults` in `NodeGroupGetOptions` (its global `NodeGroupDefaults`).
/// Absent durations are zero, as CA reads them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Defaults {
    pub scale_down_utilization_threshold: f64,
    pub scale_down_gpu_utilization_threshold: f64,
    pub scale_down_unneeded_time: Duration,
    pub scale_down_unready_time: Duration,
    pub max_node_provision_time: Duration,
    pub zero_or_max_node_scaling: bool,
    pub ignore_daemonsets_utilization: bool,
}

impl GroupOptions {
    /// True when no field is overridden.
    pub fn is_empty(&self) -> bool {
        *self == GroupOptions::default()
    }

    /// The answer to `NodeGroupGetOptions`: every overridden field replaces the default, every other field
    /// echoes it (CA takes every field of an answer, so nothing may be left unset).
    pub fn merged(&self, defaults: &Defaults) -> Defaults {
        Defaults {
            scale_down_utilization_threshold: self
                .scale_down_utilization_threshold
                .unwrap_or(defaults.scale_down_utilization_threshold),
            scale_down_gpu_utilization_threshold: self
                .scale_down_gpu_utilization_threshold
                .unwrap_or(defaults.scale_down_gpu_utilization_threshold),
            scale_down_unneeded_time: self
                .scale_down_unneeded_time
                .unwrap_or(defaults.scale_down_unneeded_time),
            scale_down_unready_time: self
                .scale_down_unready_time
                .unwrap_or(defaults.scale_down_unready_time),
            max_node_provision_time: self
                .max_node_provision_time
                .unwrap_or(defaults.max_node_provision_time),
            zero_or_max_node_scaling: self
                .zero_or_max_node_scaling
                .unwrap_or(defaults.zero_or_max_node_scaling),
            ignore_daemonsets_utilization: self
                .ignore_daemonsets_utilization
                .unwrap_or(defaults.ignore_daemonsets_utilization),
        }
    }
}

/// Reads the option annotations of one scalable resource.
///
/// `object` names it for problems (`MachineDeployment ns/name`). Returns `None` when no option parsed —
/// whether there were no option annotations at all or all of them were bad (each bad one is a problem):
/// answering with nothing but defaults would still zero CA's MaxNodeStartupTime for the group, so the
/// empty answer is strictly better. `Some` always has at least one field set.
pub fn parse(
    keys: &Keys,
    object: &str,
    annotations: &BTreeMap<String, String>,
) -> (Option<GroupOptions>, Vec<Problem>) {
    let mut options = GroupOptions::default();
    let mut problems = Vec::new();
    for (key, raw) in annotations {
        let Some(suffix) = key.strip_prefix(keys.options_prefix.as_str()) else {
            continue;
        };
        let field = Problem::annotation_field(key);
        let value = raw.trim().to_lowercase();
        if suffix.is_empty() {
            problems.push(Problem::new(
                object,
                field,
                format!(
                    "no option name after the prefix; known options: {}",
                    suffix::ALL.join(", ")
                ),
            ));
            continue;
        }
        if suffix == suffix::MAX_NODE_STARTUP_TIME {
            problems.push(Problem::new(
                object,
                field,
                "maxnodestartuptime cannot be set per group over externalgrpc (the protocol has no such field); \
                 CA's --max-node-startup-time applies",
            ));
            continue;
        }
        if !suffix::ALL.contains(&suffix) {
            problems.push(Problem::new(
                object,
                field,
                format!(
                    "unknown option {suffix:?}; known options: {}",
                    suffix::ALL.join(", ")
                ),
            ));
            continue;
        }
        if value.is_empty() {
            problems.push(Problem::new(
                object,
                field,
                "empty value; the default is used",
            ));
            continue;
        }
        let result =
            match suffix {
                suffix::SCALE_DOWN_UTILIZATION_THRESHOLD => parse_threshold(&value)
                    .map(|v| options.scale_down_utilization_threshold = Some(v)),
                suffix::SCALE_DOWN_GPU_UTILIZATION_THRESHOLD => parse_threshold(&value)
                    .map(|v| options.scale_down_gpu_utilization_threshold = Some(v)),
                suffix::SCALE_DOWN_UNNEEDED_TIME => parse_option_duration(&value)
                    .map(|v| options.scale_down_unneeded_time = Some(v)),
                suffix::SCALE_DOWN_UNREADY_TIME => {
                    parse_option_duration(&value).map(|v| options.scale_down_unready_time = Some(v))
                }
                suffix::MAX_NODE_PROVISION_TIME => parse_option_duration(&value).and_then(|v| {
                    if v.is_zero() {
                        Err(
                            "0 would make CA delete every instance that has not registered yet"
                                .to_string(),
                        )
                    } else {
                        options.max_node_provision_time = Some(v);
                        Ok(())
                    }
                }),
                suffix::ZERO_OR_MAX_NODE_SCALING => {
                    parse_bool(&value).map(|v| options.zero_or_max_node_scaling = Some(v))
                }
                suffix::IGNORE_DAEMONSETS_UTILIZATION => {
                    parse_bool(&value).map(|v| options.ignore_daemonsets_utilization = Some(v))
                }
                _ => Ok(()),
            };
        if let Err(message) = result {
            problems.push(Problem::new(
                object,
                field,
                format!("{message} (value {raw:?}); the default is used"),
            ));
        }
    }
    let options = (!options.is_empty()).then_some(options);
    (options, problems)
}

/// A utilization threshold: a finite decimal in [0, 1].
fn parse_threshold(value: &str) -> Result<f64, String> {
    let v: f64 = value.parse().map_err(|_| "not a number".to_string())?;
    if !v.is_finite() {
        return Err("not a finite number".to_string());
    }
    if !(0.0..=1.0).contains(&v) {
        return Err("a utilization threshold must be between 0 and 1".to_string());
    }
    Ok(v)
}

/// Go `strconv.ParseBool` on the lowercased value: `true`, `t`, `1`, `false`, `f`, `0`.
fn parse_bool(value: &str) -> Result<bool, String> {
    match value {
        "true" | "t" | "1" => Ok(true),
        "false" | "f" | "0" => Ok(false),
        _ => Err("not a boolean (true or false)".to_string()),
    }
}

fn parse_option_duration(value: &str) -> Result<Duration, String> {
    let nanos = parse_go_duration(value)?;
    if nanos < 0 {
        return Err("a negative duration is not allowed".to_string());
    }
    Ok(Duration::from_nanos(nanos.unsigned_abs()))
}

/// Go's `time.ParseDuration`, exactly: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+` or `0`, units `ns`, `us`, `µs`,
/// `μs`, `ms`, `s`, `m`, `h`; the result in nanoseconds within `i64`. Fractions are converted as Go does
/// (float64), so results agree with Go to the nanosecond.
pub fn parse_go_duration(input: &str) -> Result<i64, String> {
    const MAX: u64 = 1 << 63;
    let invalid = || format!("invalid duration {input:?}");
    let mut s = input.as_bytes();
    let mut neg = false;
    if let Some((&c, rest)) = s.split_first()
        && (c == b'-' || c == b'+')
    {
        neg = c == b'-';
        s = rest;
    }
    if s == b"0" {
        return Ok(0);
    }
    if s.is_empty() {
        return Err(invalid());
    }
    let mut total: u64 = 0;
    while !s.is_empty() {
        let first = s[0];
        if !(first == b'.' || first.is_ascii_digit()) {
            return Err(invalid());
        }
        // [0-9]*
        let mut v: u64 = 0;
        let mut i = 0;
        while i < s.len() && s[i].is_ascii_digit() {
            if v > MAX / 10 {
                return Err(invalid());
            }
            v = v * 10 + u64::from(s[i] - b'0');
            if v > MAX {
                return Err(invalid());
            }
            i += 1;
        }
        let pre = i > 0;
        s = &s[i..];
        // (\.[0-9]*)?
        let mut f: u64 = 0;
        let mut scale: f64 = 1.0;
        let mut post = false;
        if s.first() == Some(&b'.') {
            s = &s[1..];
            let mut i = 0;
            let mut overflow = false;
            while i < s.len() && s[i].is_ascii_digit() {
                if !overflow {
                    if f > (MAX - 1) / 10 {
                        overflow = true;
                    } else {
                        let y = f * 10 + u64::from(s[i] - b'0');
                        if y > MAX {
                            overflow = true;
                        } else {
                            f = y;
                            scale *= 10.0;
                        }
                    }
                }
                i += 1;
            }
            post = i > 0;
            s = &s[i..];
        }
        if !pre && !post {
            return Err(invalid());
        }
        // unit: everything up to the next '.' or digit
        let mut i = 0;
        while i < s.len() && !(s[i] == b'.' || s[i].is_ascii_digit()) {
            i += 1;
        }
        if i == 0 {
            return Err(format!("missing unit in duration {input:?}"));
        }
        let unit_bytes = &s[..i];
        s = &s[i..];
        let unit: u64 = match unit_bytes {
            b"ns" => 1,
            b"us" => 1_000,
            // U+00B5 micro sign, U+03BC Greek small letter mu
            b"\xc2\xb5s" | b"\xce\xbcs" => 1_000,
            b"ms" => 1_000_000,
            b"s" => 1_000_000_000,
            b"m" => 60_000_000_000,
            b"h" => 3_600_000_000_000,
            _ => {
                return Err(format!(
                    "unknown unit {:?} in duration {input:?}",
                    String::from_utf8_lossy(unit_bytes)
                ));
            }
        };
        if v > MAX / unit {
            return Err(invalid());
        }
        v *= unit;
        if f > 0 {
            // as Go: float64 is exact enough for fractions of the largest unit
            v += (f as f64 * (unit as f64 / scale)) as u64;
            if v > MAX {
                return Err(invalid());
            }
        }
        total += v;
        if total > MAX {
            return Err(invalid());
        }
    }
    if neg {
        // total <= 2^63, so -total fits in i64
        return Ok((total as i128).wrapping_neg() as i64);
    }
    if total > MAX - 1 {
        return Err(invalid());
    }
    Ok(total as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS_PER_S: i64 = 1_000_000_000;

    #[test]
    fn go_durations() {
        let cases: &[(&str, Result<i64, ()>)] = &[
            ("0", Ok(0)),
            ("+0", Ok(0)),
            ("-0", Ok(0)),
            ("5s", Ok(5 * NS_PER_S)),
            ("30s", Ok(30 * NS_PER_S)),
            ("1478s", Ok(1478 * NS_PER_S)),
            ("-5s", Ok(-5 * NS_PER_S)),
            ("+5s", Ok(5 * NS_PER_S)),
            ("-0s", Ok(0)),
            ("+0s", Ok(0)),
            ("5.0s", Ok(5 * NS_PER_S)),
            ("5.6s", Ok(5 * NS_PER_S + 600_000_000)),
            ("5.s", Ok(5 * NS_PER_S)),
            (".5s", Ok(NS_PER_S / 2)),
            ("1.0s", Ok(NS_PER_S)),
            ("1.00s", Ok(NS_PER_S)),
            ("1.004s", Ok(NS_PER_S + 4_000_000)),
            ("1.0040s", Ok(NS_PER_S + 4_000_000)),
            ("100.00100s", Ok(100 * NS_PER_S + 1_000_000)),
            ("10ns", Ok(10)),
            ("11us", Ok(11_000)),
            ("12µs", Ok(12_000)),
            ("12μs", Ok(12_000)),
            ("13ms", Ok(13_000_000)),
            ("14s", Ok(14 * NS_PER_S)),
            ("15m", Ok(15 * 60 * NS_PER_S)),
            ("16h", Ok(16 * 3600 * NS_PER_S)),
            ("3h30m", Ok((3 * 3600 + 30 * 60) * NS_PER_S)),
            ("1h30m", Ok(90 * 60 * NS_PER_S)),
            ("90s", Ok(90 * NS_PER_S)),
            ("1.5h", Ok(90 * 60 * NS_PER_S)),
            ("300ms", Ok(300_000_000)),
            ("2us", Ok(2_000)),
            (
                "10.5s4m",
                Ok(4 * 60 * NS_PER_S + 10 * NS_PER_S + 500_000_000),
            ),
            (
                "-2m3.4s",
                Ok(-(2 * 60 * NS_PER_S + 3 * NS_PER_S + 400_000_000)),
            ),
            (
                "1h2m3s4ms5us6ns",
                Ok(3600 * NS_PER_S + 2 * 60 * NS_PER_S + 3 * NS_PER_S + 4_000_000 + 5_000 + 6),
            ),
            (
                "39h9m14.425s",
                Ok(39 * 3600 * NS_PER_S + 9 * 60 * NS_PER_S + 14 * NS_PER_S + 425_000_000),
            ),
            ("52763797000ns", Ok(52_763_797_000)),
            ("0.3333333333333333333h", Ok(20 * 60 * NS_PER_S)),
            ("9007199254740993ns", Ok(9_007_199_254_740_993)),
            ("9223372036854775807ns", Ok(i64::MAX)),
            ("9223372036854775.807us", Ok(i64::MAX)),
            ("9223372036s854ms775us807ns", Ok(i64::MAX)),
            ("-9223372036854775808ns", Ok(i64::MIN)),
            ("-9223372036854775.808us", Ok(i64::MIN)),
            ("-9223372036s854ms775us808ns", Ok(i64::MIN)),
            ("-2562047h47m16.854775808s", Ok(i64::MIN)),
            ("0.100000000000000000000h", Ok(6 * 60 * NS_PER_S)),
            (
                "0.830103483285477580700h",
                Ok(49 * 60 * NS_PER_S + 48_372_539_827),
            ),
            // errors
            ("", Err(())),
            ("3", Err(())),
            ("-", Err(())),
            ("s", Err(())),
            (".", Err(())),
            ("-.", Err(())),
            (".s", Err(())),
            ("+.s", Err(())),
            ("1d", Err(())),
            ("\u{85}\u{85}", Err(())),
            ("\u{FFFD}", Err(())),
            ("9223372036854775810ns", Err(())),
            ("9223372036854775808ns", Err(())),
            ("-9223372036854775809ns", Err(())),
            ("9223372036854776us", Err(())),
            ("3000000h", Err(())),
            ("9223372036854775.808us", Err(())),
            ("9223372036854ms775us808ns", Err(())),
            ("1h 30m", Err(())),
            (" 1h", Err(())),
            ("1H", Err(())),
        ];
        for (input, want) in cases {
            let got = parse_go_duration(input);
            match want {
                Ok(n) => assert_eq!(got, Ok(*n), "{input:?}"),
                Err(()) => assert!(got.is_err(), "{input:?} parsed as {got:?}"),
            }
        }
    }

    fn keys() -> Keys {
        Keys::default()
    }

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    format!("cluster.x-k8s.io/autoscaling-options-{k}"),
                    v.to_string(),
                )
            })
            .collect()
    }

    const OBJ: &str = "MachineDeployment default/md-0";

    #[test]
    fn no_option_annotations_is_none() {
        let mut a = BTreeMap::new();
        a.insert(
            "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size".to_string(),
            "3".to_string(),
        );
        a.insert(
            "example.com/autoscaling-options-scaledownunneededtime".to_string(),
            "1m".to_string(),
        );
        let (opts, problems) = parse(&keys(), OBJ, &a);
        assert_eq!(opts, None);
        assert!(problems.is_empty());
    }

    #[test]
    fn every_option_parses() {
        let a = ann(&[
            ("scaledownutilizationthreshold", "0.6"),
            ("scaledowngpuutilizationthreshold", "1"),
            ("scaledownunneededtime", "1h30m"),
            ("scaledownunreadytime", "90s"),
            ("maxnodeprovisiontime", "1.5h"),
            ("zeroormaxnodescaling", "True"),
            ("ignoredaemonsetsutilization", "false"),
        ]);
        let (opts, problems) = parse(&keys(), OBJ, &a);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            opts,
            Some(GroupOptions {
                scale_down_utilization_threshold: Some(0.6),
                scale_down_gpu_utilization_threshold: Some(1.0),
                scale_down_unneeded_time: Some(Duration::from_secs(5400)),
                scale_down_unready_time: Some(Duration::from_secs(90)),
                max_node_provision_time: Some(Duration::from_secs(5400)),
                zero_or_max_node_scaling: Some(true),
                ignore_daemonsets_utilization: Some(false),
            })
        );
    }

    #[test]
    fn values_are_lowercased_and_trimmed() {
        let a = ann(&[
            ("scaledownunneededtime", " 10M "),
            ("zeroormaxnodescaling", "TRUE"),
        ]);
        let (opts, problems) = parse(&keys(), OBJ, &a);
        assert!(problems.is_empty(), "{problems:?}");
        let opts = opts.unwrap_or_default();
        assert_eq!(
            opts.scale_down_unneeded_time,
            Some(Duration::from_secs(600))
        );
        assert_eq!(opts.zero_or_max_node_scaling, Some(true));
    }

    #[test]
    fn bad_values_are_problems_and_stay_default() {
        // (suffix, value, problem message fragment)
        let cases = [
            ("scaledownutilizationthreshold", "abc", "not a number"),
            ("scaledownutilizationthreshold", "1.5", "between 0 and 1"),
            ("scaledownutilizationthreshold", "-0.1", "between 0 and 1"),
            ("scaledownutilizationthreshold", "nan", "finite"),
            ("scaledowngpuutilizationthreshold", "inf", "finite"),
            ("scaledownunneededtime", "10", "missing unit"),
            ("scaledownunneededtime", "-1m", "negative"),
            ("scaledownunneededtime", "1d", "unknown unit"),
            ("maxnodeprovisiontime", "0", "delete every instance"),
            ("maxnodeprovisiontime", "0s", "delete every instance"),
            ("zeroormaxnodescaling", "yes", "not a boolean"),
            ("ignoredaemonsetsutilization", "", "empty value"),
            ("maxnodestartuptime", "10m", "externalgrpc"),
            ("scaledownunneededTime", "10m", "unknown option"),
            ("", "10m", "no option name"),
        ];
        for (suffix, value, fragment) in cases {
            let a = ann(&[(suffix, value), ("scaledownunreadytime", "5m")]);
            let (opts, problems) = parse(&keys(), OBJ, &a);
            assert_eq!(problems.len(), 1, "{suffix}={value}: {problems:?}");
            let p = &problems[0];
            assert_eq!(p.object, OBJ);
            assert_eq!(
                p.field,
                format!("metadata.annotations[cluster.x-k8s.io/autoscaling-options-{suffix}]")
            );
            assert!(
                p.message.contains(fragment),
                "{suffix}={value}: {}",
                p.message
            );
            // the good option still applies, the bad one stays default
            assert_eq!(
                opts,
                Some(GroupOptions {
                    scale_down_unready_time: Some(Duration::from_secs(300)),
                    ..GroupOptions::default()
                }),
                "{suffix}={value}"
            );
        }
    }

    #[test]
    fn all_bad_is_none_with_problems() {
        let a = ann(&[("scaledownunneededtime", "soon"), ("frobnicate", "1")]);
        let (opts, problems) = parse(&keys(), OBJ, &a);
        assert_eq!(opts, None);
        assert_eq!(problems.len(), 2);
    }

    #[test]
    fn custom_group_prefix() {
        let keys = Keys::new("test.k8s.io");
        let mut a = BTreeMap::new();
        a.insert(
            "test.k8s.io/autoscaling-options-scaledownunneededtime".to_string(),
            "2m".to_string(),
        );
        a.insert(
            "cluster.x-k8s.io/autoscaling-options-scaledownunreadytime".to_string(),
            "3m".to_string(),
        );
        let (opts, problems) = parse(&keys, OBJ, &a);
        assert!(problems.is_empty());
        assert_eq!(
            opts,
            Some(GroupOptions {
                scale_down_unneeded_time: Some(Duration::from_secs(120)),
                ..GroupOptions::default()
            })
        );
    }

    #[test]
    fn merged_overrides_and_echoes() {
        let defaults = Defaults {
            scale_down_utilization_threshold: 0.5,
            scale_down_gpu_utilization_threshold: 0.5,
            scale_down_unneeded_time: Duration::from_secs(600),
            scale_down_unready_time: Duration::from_secs(1200),
            max_node_provision_time: Duration::from_secs(900),
            zero_or_max_node_scaling: false,
            ignore_daemonsets_utilization: true,
        };
        assert_eq!(GroupOptions::default().merged(&defaults), defaults);
        let opts = GroupOptions {
            scale_down_gpu_utilization_threshold: Some(0.2),
            max_node_provision_time: Some(Duration::from_secs(60)),
            zero_or_max_node_scaling: Some(true),
            ignore_daemonsets_utilization: Some(false),
            ..GroupOptions::default()
        };
        assert_eq!(
            opts.merged(&defaults),
            Defaults {
                scale_down_gpu_utilization_threshold: 0.2,
                max_node_provision_time: Duration::from_secs(60),
                zero_or_max_node_scaling: true,
                ignore_daemonsets_utilization: false,
                ..defaults.clone()
            }
        );
    }
}
