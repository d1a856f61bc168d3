//! Per-group autoscaling options from `<CAPI_GROUP>/autoscaling-options-<suffix>` annotations, pure.
//!
//! Key-compatible with the in-tree provider (same prefix, same lowercase suffixes, values lowercased before
//! parsing), and stricter where it helps: unknown suffixes, empty values, out-of-range thresholds, negative
//! durations and a zero `maxnodeprovisiontime` are reported as problems instead of being silently kept or
//! applied. A bad value leaves its field `None`, so CA's default applies to it.
//!
//! Over externalgrpc an options answer replaces *all* of CA's per-group options (fields the proto lacks, such
//! as MaxNodeStartupTime, become zero), so [`parse`] returns `None` unless at least one option parsed: the
//! service then answers the empty response and CA keeps its defaults. See docs/architecture.md, invariant 5.

use crate::capi::Labels;
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

/// What answering a group's options costs with CA ≥ 1.35, which takes every field of an answer: the
/// max node startup time the proto has no field for becomes 0 for that group. Shown by `check` under
/// every group whose options are answered.
pub const STARTUP_TIME_NOTE: &str = "CA >= 1.35 sets this group's max node startup time to 0 whenever its \
     options are answered (the protocol has no field for it, kubernetes/autoscaler#10245): a new node counts \
     as unready as soon as it registers, and CA may scale the group up again while its nodes boot. \
     Keep per-group options only where needed, or set them on CA for every group";

/// Reads the option annotations of one scalable resource.
///
/// `object` names it for problems (`MachineDeployment ns/name`). Returns `None` when no option parsed —
/// whether there were no option annotations at all or all of them were bad (each bad one is a problem):
/// answering with nothing but defaults would still zero CA's MaxNodeStartupTime for the group, so the
/// empty answer is strictly better. `Some` always has at least one field set.
pub fn parse(
    keys: &Keys,
    object: impl Into<crate::problem::Subject> + Copy,
    annotations: &Labels,
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
                "maxnodestartuptime cannot be set per group over externalgrpc (the protocol has no such field, \
                 kubernetes/autoscaler#10245); CA's --max-node-startup-time applies",
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
                        Err(OptionValueError::ZeroProvisionTime)
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

/// Why an option's value is not used (the problem adds the value and that the default is used).
#[derive(Debug, thiserror::Error)]
enum OptionValueError {
    #[error("not a number")]
    NotANumber(#[source] std::num::ParseFloatError),
    #[error("not a finite number")]
    NotFinite,
    #[error("a utilization threshold must be between 0 and 1")]
    ThresholdOutOfRange,
    #[error("not a boolean (true or false)")]
    NotABoolean,
    #[error(transparent)]
    Duration(#[from] DurationError),
    #[error("a negative duration is not allowed")]
    NegativeDuration,
    #[error("0 would make CA delete every instance that has not registered yet")]
    ZeroProvisionTime,
}

/// Why a text is not a Go duration, in the words of Go's `time.ParseDuration`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("invalid duration {0:?}")]
    Invalid(String),
    #[error("missing unit in duration {0:?}")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in duration {input:?}")]
    UnknownUnit { unit: String, input: String },
}

/// A utilization threshold: a finite decimal in [0, 1].
fn parse_threshold(value: &str) -> Result<f64, OptionValueError> {
    let v: f64 = value.parse().map_err(OptionValueError::NotANumber)?;
    if !v.is_finite() {
        return Err(OptionValueError::NotFinite);
    }
    if !(0.0..=1.0).contains(&v) {
        return Err(OptionValueError::ThresholdOutOfRange);
    }
    Ok(v)
}

/// Go `strconv.ParseBool` on the lowercased value: `true`, `t`, `1`, `false`, `f`, `0`.
fn parse_bool(value: &str) -> Result<bool, OptionValueError> {
    match value {
        "true" | "t" | "1" => Ok(true),
        "false" | "f" | "0" => Ok(false),
        _ => Err(OptionValueError::NotABoolean),
    }
}

fn parse_option_duration(value: &str) -> Result<Duration, OptionValueError> {
    let nanos = parse_go_duration(value)?;
    if nanos < 0 {
        return Err(OptionValueError::NegativeDuration);
    }
    Ok(Duration::from_nanos(nanos.unsigned_abs()))
}

/// Go's `time.ParseDuration`, exactly: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+` or `0`, units `ns`, `us`, `µs`,
/// `μs`, `ms`, `s`, `m`, `h`; the result in nanoseconds within `i64`. Fractions are converted as Go does
/// (float64), so results agree with Go to the nanosecond.
pub fn parse_go_duration(input: &str) -> Result<i64, DurationError> {
    const MAX: u64 = 1 << 63;
    let invalid = || DurationError::Invalid(input.to_string());
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
            return Err(DurationError::MissingUnit(input.to_string()));
        }
        let unit_bytes = &s[..i];
        s = &s[i..];
        let unit = unit_nanos(unit_bytes).ok_or_else(|| DurationError::UnknownUnit {
            unit: String::from_utf8_lossy(unit_bytes).into_owned(),
            input: input.to_string(),
        })?;
        if v > MAX / unit {
            return Err(invalid());
        }
        v *= unit;
        if f > 0 {
            // as Go: float64 is exact enough for fractions of the largest unit
            v = v
                .checked_add((f as f64 * (unit as f64 / scale)) as u64)
                .ok_or_else(invalid)?;
            if v > MAX {
                return Err(invalid());
            }
        }
        total = total.checked_add(v).ok_or_else(invalid)?;
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

/// Nanoseconds per unit of Go's `time.ParseDuration`.
fn unit_nanos(unit: &[u8]) -> Option<u64> {
    Some(match unit {
        b"ns" => 1,
        b"us" => 1_000,
        // U+00B5 micro sign, U+03BC Greek small letter mu
        b"\xc2\xb5s" | b"\xce\xbcs" => 1_000,
        b"ms" => 1_000_000,
        b"s" => 1_000_000_000,
        b"m" => 60_000_000_000,
        b"h" => 3_600_000_000_000,
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
