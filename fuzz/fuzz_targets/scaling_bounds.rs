//! The min/max size annotations (`<CAPI_GROUP>/cluster-api-autoscaler-node-group-{min,max}-size`).
//!
//! Contract: no panic; neither annotation → not a node group; accepted bounds are the annotations' values
//! (min 0 when absent), 0 ≤ min ≤ max; an error names the annotation that is wrong (the max size one
//! when it is missing or below min).
#![no_main]

use capi_autoscaler_provider::capi::scaling_bounds;
use capi_autoscaler_provider::capi::{Keys, Labels};
use capi_autoscaler_provider_fuzz::{annotation_field, annotations};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const TOKENS: &[&str] = &[
    "0",
    "1",
    "3",
    "10",
    "-",
    "+",
    " ",
    "\t",
    "00",
    "2147483647",
    "2147483648",
    "-2147483648",
    "1.5",
    "1e3",
    "x",
    "٣",
];

fn run(u: &mut Unstructured) -> Result<()> {
    let keys = if u.ratio(1, 4)? {
        Keys::new("cluster.example.dev")
    } else {
        Keys::default()
    };
    let ann = annotations(
        u,
        &[&keys.min_size, &keys.max_size, &keys.options_prefix],
        TOKENS,
    )?;
    let read = |key: &str| ann.get(key).map(|v| v.trim().parse::<i32>().ok());
    let (min, max) = (read(&keys.min_size), read(&keys.max_size));
    match scaling_bounds(&keys, &Labels::from(ann.clone())) {
        Ok(None) => assert!(min.is_none() && max.is_none(), "{ann:?}"),
        Ok(Some((lo, hi))) => {
            assert!(0 <= lo && lo <= hi, "{ann:?} → {lo}..{hi}");
            assert_eq!(Some(Some(hi)), max, "{ann:?}");
            assert_eq!(min.unwrap_or(Some(0)), Some(lo), "{ann:?}");
        }
        Err(p) => {
            assert!(!p.message.is_empty());
            let (min_field, max_field) = (
                annotation_field(&keys.min_size),
                annotation_field(&keys.max_size),
            );
            assert!(p.field == min_field || p.field == max_field, "{p:?}");
            // Either the named annotation is there and wrong, or max is missing while min is set.
            let named = if p.field == min_field { min } else { max };
            assert!(
                named.is_some() || (p.field == max_field && min.is_some()),
                "{ann:?}: {p:?}"
            );
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
