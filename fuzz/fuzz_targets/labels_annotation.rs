//! The scale-from-zero labels annotation (`capacity.cluster-autoscaler.kubernetes.io/labels`: `k=v,k2=v2`).
//!
//! Contract: no panic; every entry is either a label (a valid qualified key and label value, trimmed) or
//! exactly one problem naming the object and the annotation; the labels, written back as `k=v,…`, parse to
//! the same labels with no problem.
#![no_main]

use capi_autoscaler_provider::capi::Labels;
use capi_autoscaler_provider::capi::capacity::LABELS;
use capi_autoscaler_provider::capi::names::{is_label_value, is_qualified_name};
use capi_autoscaler_provider::template::parse_labels_annotation;
use capi_autoscaler_provider_fuzz::{annotation_field, text_of};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "MachineDeployment ns/md";
const TOKENS: &[&str] = &[
    "a",
    "b",
    "Z",
    "0",
    "-",
    "_",
    ".",
    "/",
    "=",
    ",",
    " ",
    "example.com/",
    "node-role.kubernetes.io/",
    "kubernetes.io/",
    "cluster-api/accelerator",
    "nvidia-tesla-t4",
    "=,",
    "==",
    "ä",
    "a123456789012345678901234567890123456789012345678901234567890123",
];

fn parse(raw: &str) -> (Vec<(String, String)>, Vec<String>) {
    let ann: Labels = [(LABELS, raw)].into_iter().collect();
    let mut problems = Vec::new();
    let labels = parse_labels_annotation(OBJECT, &ann, &mut problems);
    for p in &problems {
        assert_eq!(p.object, OBJECT);
        assert_eq!(p.field, annotation_field(LABELS));
    }
    (labels, problems.into_iter().map(|p| p.message).collect())
}

fn run(u: &mut Unstructured) -> Result<()> {
    let raw = text_of(u, TOKENS, 24)?;
    let (labels, problems) = parse(&raw);
    let entries = raw.split(',').filter(|e| !e.trim().is_empty()).count();
    assert_eq!(labels.len() + problems.len(), entries, "{raw:?}");
    for (k, v) in &labels {
        assert!(
            is_qualified_name(k) && is_label_value(v),
            "{raw:?}: {k:?}={v:?}"
        );
        assert_eq!(k.trim(), k);
    }
    let written: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let again = parse(&written.join(","));
    assert_eq!(again, (labels, Vec::new()), "{raw:?}");
    // Without the annotation there is nothing to read.
    let mut problems = Vec::new();
    assert!(parse_labels_annotation(OBJECT, &Labels::default(), &mut problems).is_empty());
    assert!(problems.is_empty());
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
