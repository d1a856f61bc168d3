//! The per-group `<CAPI_GROUP>/autoscaling-options-*` annotations (thresholds, Go durations, booleans) and
//! the NodeGroupGetOptions answer made of them and CA's defaults from the wire.
//!
//! Contract: no panic; each option is set exactly when its value is valid (a threshold in [0, 1], a
//! non-negative Go duration, non-zero for `maxnodeprovisiontime`, a Go boolean), and then to that value;
//! every other option-prefixed annotation is exactly one problem naming it; options are `None` rather than
//! empty. The answer echoes every default the group does not override and carries every override.
#![no_main]

use std::time::Duration;

use capi_autoscaler_provider::capi::Keys;
use capi_autoscaler_provider::capi::Labels;
use capi_autoscaler_provider::grpc::options_response;
use capi_autoscaler_provider::options::{self, GroupOptions, parse_go_duration, suffix};
use capi_autoscaler_provider::proto::{LegacyDuration, NodeGroupAutoscalingOptions};
use capi_autoscaler_provider_fuzz::{annotation_field, annotations};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "MachineSet ns/ms";
const TOKENS: &[&str] = &[
    "0",
    "1",
    "5",
    "30",
    "0.5",
    ".",
    "-",
    "+",
    " ",
    "s",
    "m",
    "h",
    "ms",
    "us",
    "µs",
    "ns",
    "1h30m",
    "TRUE",
    "true",
    "t",
    "F",
    "false",
    "yes",
    "1.1",
    "nan",
    "inf",
    "1e-1",
    "9223372036854775807",
    "9223372036854775808",
    "2562047h",
];

/// What an option's value should give, by the rules above.
fn expected(suffix: &str, raw: &str) -> Option<Option<()>> {
    let v = raw.trim().to_lowercase();
    if v.is_empty() {
        return Some(None);
    }
    let duration = || parse_go_duration(&v).ok().filter(|n| *n >= 0);
    let ok = match suffix {
        suffix::SCALE_DOWN_UTILIZATION_THRESHOLD | suffix::SCALE_DOWN_GPU_UTILIZATION_THRESHOLD => {
            v.parse::<f64>()
                .is_ok_and(|t| t.is_finite() && (0.0..=1.0).contains(&t))
        }
        suffix::SCALE_DOWN_UNNEEDED_TIME | suffix::SCALE_DOWN_UNREADY_TIME => duration().is_some(),
        suffix::MAX_NODE_PROVISION_TIME => duration().is_some_and(|n| n > 0),
        suffix::ZERO_OR_MAX_NODE_SCALING | suffix::IGNORE_DAEMONSETS_UTILIZATION => {
            matches!(v.as_str(), "true" | "t" | "1" | "false" | "f" | "0")
        }
        _ => return None,
    };
    Some(ok.then_some(()))
}

fn wire_duration(u: &mut Unstructured) -> Result<Option<prost_types::Duration>> {
    Ok(if u.arbitrary()? {
        Some(prost_types::Duration {
            seconds: u.arbitrary()?,
            nanos: u.arbitrary()?,
        })
    } else {
        None
    })
}

fn legacy(u: &mut Unstructured) -> Result<Option<LegacyDuration>> {
    Ok(if u.arbitrary()? {
        Some(LegacyDuration {
            duration: u.arbitrary()?,
        })
    } else {
        None
    })
}

/// A CA default duration that the answer must echo unchanged: normalized, not negative.
fn echoable(
    new: &Option<prost_types::Duration>,
    legacy: &Option<LegacyDuration>,
) -> Option<Duration> {
    match (new, legacy) {
        (Some(d), _) => (d.seconds >= 0 && (0..1_000_000_000).contains(&d.nanos))
            .then(|| Duration::new(d.seconds as u64, d.nanos as u32)),
        (None, Some(l)) => (l.duration >= 0).then(|| Duration::from_nanos(l.duration as u64)),
        (None, None) => Some(Duration::ZERO),
    }
}

fn answered(new: &Option<prost_types::Duration>, legacy: &Option<LegacyDuration>) -> Duration {
    let d = new.as_ref().expect("the answer carries every duration");
    assert!(
        d.seconds >= 0 && (0..1_000_000_000).contains(&d.nanos),
        "{d:?}"
    );
    let wire = Duration::new(d.seconds as u64, d.nanos as u32);
    let l = legacy.as_ref().expect("and its legacy spelling").duration;
    assert!(l >= 0);
    assert_eq!(i64::try_from(wire.as_nanos()).unwrap_or(i64::MAX), l);
    wire
}

fn run(u: &mut Unstructured) -> Result<()> {
    let keys = Keys::default();
    let mut known: Vec<String> = suffix::ALL
        .iter()
        .chain(&[
            suffix::MAX_NODE_STARTUP_TIME,
            "",
            "scaleDownUnneededTime",
            "bogus",
        ])
        .map(|s| format!("{}{s}", keys.options_prefix))
        .collect();
    known.push(keys.min_size.clone());
    let known: Vec<&str> = known.iter().map(String::as_str).collect();
    let ann = annotations(u, &known, TOKENS)?;

    let (parsed, problems) = options::parse(&keys, OBJECT, &Labels::from(ann.clone()));
    let o = parsed.clone().unwrap_or_default();
    assert!(parsed.as_ref().is_none_or(|p| !p.is_empty()));
    let mut problem_fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
    problem_fields.sort_unstable();
    let mut want_fields = Vec::new();
    for (key, raw) in &ann {
        let Some(sfx) = key.strip_prefix(&keys.options_prefix) else {
            continue;
        };
        let v = raw.trim().to_lowercase();
        let set = match sfx {
            suffix::SCALE_DOWN_UTILIZATION_THRESHOLD => o
                .scale_down_utilization_threshold
                .map(|t| assert_eq!(v.parse::<f64>().ok(), Some(t))),
            suffix::SCALE_DOWN_GPU_UTILIZATION_THRESHOLD => o
                .scale_down_gpu_utilization_threshold
                .map(|t| assert_eq!(v.parse::<f64>().ok(), Some(t))),
            suffix::SCALE_DOWN_UNNEEDED_TIME => o
                .scale_down_unneeded_time
                .map(|d| assert_eq!(parse_go_duration(&v).ok(), i64::try_from(d.as_nanos()).ok())),
            suffix::SCALE_DOWN_UNREADY_TIME => o
                .scale_down_unready_time
                .map(|d| assert_eq!(parse_go_duration(&v).ok(), i64::try_from(d.as_nanos()).ok())),
            suffix::MAX_NODE_PROVISION_TIME => o
                .max_node_provision_time
                .map(|d| assert_eq!(parse_go_duration(&v).ok(), i64::try_from(d.as_nanos()).ok())),
            suffix::ZERO_OR_MAX_NODE_SCALING => o
                .zero_or_max_node_scaling
                .map(|b| assert_eq!(b, matches!(v.as_str(), "true" | "t" | "1"))),
            suffix::IGNORE_DAEMONSETS_UTILIZATION => o
                .ignore_daemonsets_utilization
                .map(|b| assert_eq!(b, matches!(v.as_str(), "true" | "t" | "1"))),
            _ => None,
        };
        let want = expected(sfx, raw).flatten();
        assert_eq!(set.is_some(), want.is_some(), "{key:?}={raw:?}: {o:?}");
        if want.is_none() {
            want_fields.push(annotation_field(key));
        }
    }
    want_fields.sort_unstable();
    assert_eq!(problem_fields, want_fields, "{ann:?}");
    for p in &problems {
        assert_eq!(p.object, OBJECT);
        assert!(!p.message.is_empty());
    }

    // NodeGroupGetOptions: CA's defaults as they come off the wire, merged with the group's options.
    let defaults = NodeGroupAutoscalingOptions {
        scale_down_utilization_threshold: u.arbitrary()?,
        scale_down_gpu_utilization_threshold: u.arbitrary()?,
        scale_down_unneeded_time: legacy(u)?,
        scale_down_unready_time: legacy(u)?,
        max_node_provision_time: legacy(u)?,
        zero_or_max_node_scaling: u.arbitrary()?,
        ignore_daemon_sets_utilization: u.arbitrary()?,
        scale_down_unneeded_duration: wire_duration(u)?,
        scale_down_unready_duration: wire_duration(u)?,
        max_node_provision_duration: wire_duration(u)?,
    };
    let with_defaults = u.ratio(15, 16)?;
    let answer = options_response(parsed.as_ref(), with_defaults.then_some(&defaults));
    let Some(group) = parsed.as_ref() else {
        assert_eq!(answer.ok(), Some(Default::default()));
        return Ok(());
    };
    let Ok(answer) = answer else {
        assert!(!with_defaults, "refused with defaults");
        return Ok(());
    };
    let w = answer
        .node_group_autoscaling_options
        .expect("an answer for a group with options");
    let same = |a: f64, b: f64| a.to_bits() == b.to_bits();
    let GroupOptions {
        scale_down_utilization_threshold: t,
        scale_down_gpu_utilization_threshold: gpu_t,
        scale_down_unneeded_time: unneeded,
        scale_down_unready_time: unready,
        max_node_provision_time: provision,
        zero_or_max_node_scaling: zero_or_max,
        ignore_daemonsets_utilization: ignore_ds,
    } = group.clone();
    assert!(same(
        w.scale_down_utilization_threshold,
        t.unwrap_or(defaults.scale_down_utilization_threshold)
    ));
    assert!(same(
        w.scale_down_gpu_utilization_threshold,
        gpu_t.unwrap_or(defaults.scale_down_gpu_utilization_threshold)
    ));
    assert_eq!(
        w.zero_or_max_node_scaling,
        zero_or_max.unwrap_or(defaults.zero_or_max_node_scaling)
    );
    assert_eq!(
        w.ignore_daemon_sets_utilization,
        ignore_ds.unwrap_or(defaults.ignore_daemon_sets_utilization)
    );
    for (ours, new, legacy, out_new, out_legacy) in [
        (
            unneeded,
            &defaults.scale_down_unneeded_duration,
            &defaults.scale_down_unneeded_time,
            &w.scale_down_unneeded_duration,
            &w.scale_down_unneeded_time,
        ),
        (
            unready,
            &defaults.scale_down_unready_duration,
            &defaults.scale_down_unready_time,
            &w.scale_down_unready_duration,
            &w.scale_down_unready_time,
        ),
        (
            provision,
            &defaults.max_node_provision_duration,
            &defaults.max_node_provision_time,
            &w.max_node_provision_duration,
            &w.max_node_provision_time,
        ),
    ] {
        let want = match ours {
            Some(d) => Some(d),
            None => echoable(new, legacy),
        };
        if let Some(want) = want {
            assert_eq!(answered(out_new, out_legacy), want);
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
