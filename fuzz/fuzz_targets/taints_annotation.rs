//! The scale-from-zero taints annotation (`capacity.cluster-autoscaler.kubernetes.io/taints`:
//! `key=value:Effect,key:Effect`).
//!
//! Contract: no panic; every entry is either a taint (valid key and value, effect `NoSchedule`,
//! `PreferNoSchedule` or `NoExecute`) or exactly one problem naming the object and the annotation; the
//! taints, written back as the provider writes them (`key=value:Effect`), parse to the same taints with no
//! problem.
#![no_main]

use capi_autoscaler_provider::capi::capacity::TAINTS;
use capi_autoscaler_provider::capi::names::{is_label_value, is_qualified_name};
use capi_autoscaler_provider::capi::{Labels, Taint};
use capi_autoscaler_provider::template::{parse_taints_annotation, taint_string};
use capi_autoscaler_provider_fuzz::{annotation_field, text_of};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "MachinePool ns/mp";
const TOKENS: &[&str] = &[
    "a",
    "key",
    "dedicated",
    "gpu",
    "0",
    "-",
    "_",
    ".",
    "/",
    "=",
    ":",
    ",",
    " ",
    "example.com/",
    "NoSchedule",
    "PreferNoSchedule",
    "NoExecute",
    "noschedule",
    "true",
    "::",
    "==",
    "ß",
];
const EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];

fn parse(raw: &str) -> (Vec<Taint>, Vec<String>) {
    let ann: Labels = [(TAINTS, raw)].into_iter().collect();
    let mut problems = Vec::new();
    let taints = parse_taints_annotation(OBJECT, &ann, &mut problems);
    for p in &problems {
        assert_eq!(p.object, OBJECT);
        assert_eq!(p.field, annotation_field(TAINTS));
    }
    (taints, problems.into_iter().map(|p| p.message).collect())
}

fn run(u: &mut Unstructured) -> Result<()> {
    let raw = text_of(u, TOKENS, 24)?;
    let (taints, problems) = parse(&raw);
    let entries = raw.split(',').filter(|e| !e.trim().is_empty()).count();
    assert_eq!(taints.len() + problems.len(), entries, "{raw:?}");
    for t in &taints {
        assert!(
            is_qualified_name(&t.key)
                && is_label_value(&t.value)
                && EFFECTS.contains(&t.effect.as_str()),
            "{raw:?}: {t:?}"
        );
    }
    let written: Vec<String> = taints.iter().map(taint_string).collect();
    let again = parse(&written.join(","));
    assert_eq!(again, (taints, Vec::new()), "{raw:?}");
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
