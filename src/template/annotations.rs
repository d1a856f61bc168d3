//! The group's annotations a template reads beyond capacity: counts, labels, taints, and the ones
//! externalgrpc cannot carry.

use crate::capi::Labels;

use crate::capi::names::{is_label_value, is_qualified_name};
use crate::capi::{Taint, capacity};
use crate::problem::{Problem, Subject};

const TAINT_EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];

/// The capacity annotations the in-tree provider honours and the externalgrpc protocol cannot carry:
/// a template is one `v1.Node`, with no room for the ResourceSlices or the CSINode they describe. Each
/// one set is a problem saying so and what CA does instead, rather than being dropped in silence.
pub fn not_carried(object: impl Into<Subject> + Copy, annotations: &Labels) -> Vec<Problem> {
    let set = |key: &str| annotations.get(key).is_some_and(|v| !v.trim().is_empty());
    let mut problems = Vec::new();
    if set(capacity::DRA_DRIVER) {
        problems.push(Problem::new(
            object,
            Problem::annotation_field(capacity::DRA_DRIVER),
            "not carried over externalgrpc: a template is one Node and the protocol has no field for the \
             ResourceSlices this annotation describes (kubernetes/autoscaler#10277); CA simulates this \
             group's node without DRA devices, so a pod that claims devices does not scale it up from zero \
             (it can once the group has a node, whose real ResourceSlices CA sees)",
        ));
    }
    if set(capacity::CSI_DRIVER) {
        problems.push(Problem::new(
            object,
            Problem::annotation_field(capacity::CSI_DRIVER),
            "not carried over externalgrpc: the protocol has no field for the CSINode this annotation \
             describes; CA simulates this group's node without a CSINode: with --enable-csi-node-aware-scheduling a pod with CSI volumes does not scale it up from \
             zero (kubernetes/autoscaler#10131), without it the drivers' attach limits are not considered",
        ));
    }
    problems
}

/// An integer annotation (Go `strconv.ParseInt`): absent or empty → `None`; malformed or negative → a
/// problem and `None`.
pub fn parse_count(
    object: impl Into<Subject> + Copy,
    annotations: &Labels,
    key: &str,
    problems: &mut Vec<Problem>,
) -> Option<i64> {
    let raw = annotations.get(key).map(|v| v.trim()).unwrap_or("");
    if raw.is_empty() {
        return None;
    }
    match raw.parse::<i64>() {
        Ok(n) if n >= 0 => Some(n),
        Ok(_) => {
            problems.push(Problem::new(
                object,
                Problem::annotation_field(key),
                format!("{raw:?} is negative; ignored"),
            ));
            None
        }
        Err(_) => {
            problems.push(Problem::new(
                object,
                Problem::annotation_field(key),
                format!("{raw:?} is not an integer; ignored"),
            ));
            None
        }
    }
}

/// `k=v,k2=v2`; entries trimmed, empty entries skipped, malformed entries reported and skipped.
pub fn parse_labels_annotation(
    object: impl Into<Subject> + Copy,
    annotations: &Labels,
    problems: &mut Vec<Problem>,
) -> Vec<(String, String)> {
    let Some(raw) = annotations.get(capacity::LABELS) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in raw.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: &str| {
            Problem::new(
                object,
                Problem::annotation_field(capacity::LABELS),
                format!("label {entry:?}: {why}; ignored"),
            )
        };
        let Some((k, v)) = entry.split_once('=') else {
            problems.push(bad("expected key=value"));
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        if !is_qualified_name(k) {
            problems.push(bad("invalid key"));
        } else if !is_label_value(v) {
            problems.push(bad(
                "invalid value (at most 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends)",
            ));
        } else {
            out.push((k.to_string(), v.to_string()));
        }
    }
    out
}

/// `key=value:Effect` or `key:Effect`, comma separated; malformed entries reported and skipped.
pub fn parse_taints_annotation(
    object: impl Into<Subject> + Copy,
    annotations: &Labels,
    problems: &mut Vec<Problem>,
) -> Vec<Taint> {
    let Some(raw) = annotations.get(capacity::TAINTS) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in raw.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let taint = match entry.split_once(':') {
            None => Err("expected key=value:Effect or key:Effect".to_string()),
            Some((kv, effect)) => {
                let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
                let t = Taint {
                    key: key.trim().to_string(),
                    value: value.trim().to_string(),
                    effect: effect.trim().to_string(),
                };
                validate_taint(&t).map(|()| t)
            }
        };
        match taint {
            Ok(t) => out.push(t),
            Err(e) => problems.push(Problem::new(
                object,
                Problem::annotation_field(capacity::TAINTS),
                format!("taint {entry:?}: {e}; ignored"),
            )),
        }
    }
    out
}

pub(super) fn validate_taint(t: &Taint) -> Result<(), String> {
    if !is_qualified_name(&t.key) {
        return Err(format!("invalid key {:?}", t.key));
    }
    if !is_label_value(&t.value) {
        return Err(format!("invalid value {:?}", t.value));
    }
    if !TAINT_EFFECTS.contains(&t.effect.as_str()) {
        return Err(format!(
            "invalid effect {:?} (expected one of {})",
            t.effect,
            TAINT_EFFECTS.join(", ")
        ));
    }
    Ok(())
}
