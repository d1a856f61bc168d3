//! The integer scale-from-zero annotations: `capacity.cluster-autoscaler.kubernetes.io/gpu-count` and
//! `…/maxPods` (Go `strconv.ParseInt`).
//!
//! Contract: no panic; absent or blank → nothing and no problem; otherwise either the non-negative integer
//! the trimmed text spells, or exactly one problem naming the object and that annotation.
#![no_main]

use capi_autoscaler_provider::capi::Labels;
use capi_autoscaler_provider::capi::capacity::{GPU_COUNT, MAX_PODS};
use capi_autoscaler_provider::template::parse_count;
use capi_autoscaler_provider_fuzz::{annotation_field, text_of};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "MachineDeployment ns/md";
const TOKENS: &[&str] = &[
    "0",
    "1",
    "8",
    "110",
    "-",
    "+",
    " ",
    "\t",
    "9223372036854775807",
    "9223372036854775808",
    "1.0",
    "1e2",
    "0x10",
    "٣",
];

fn run(u: &mut Unstructured) -> Result<()> {
    let key = *u.choose(&[GPU_COUNT, MAX_PODS])?;
    let ann: Labels = if u.ratio(1, 16)? {
        Labels::default()
    } else {
        [(key.to_string(), text_of(u, TOKENS, 6)?)]
            .into_iter()
            .collect()
    };
    let mut problems = Vec::new();
    let got = parse_count(OBJECT, &ann, key, &mut problems);
    let raw = ann.get(key).map(str::trim).unwrap_or("");
    match got {
        Some(n) => {
            assert!(n >= 0 && problems.is_empty(), "{raw:?} → {n}");
            assert_eq!(raw.parse::<i64>().ok(), Some(n), "{raw:?}");
        }
        None if raw.is_empty() => assert!(problems.is_empty(), "{problems:?}"),
        None => {
            assert_eq!(problems.len(), 1, "{raw:?}: {problems:?}");
            assert_eq!(problems[0].object, OBJECT);
            assert_eq!(problems[0].field, annotation_field(key));
            assert!(raw.parse::<i64>().is_ok_and(|n| n < 0) || raw.parse::<i64>().is_err());
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
