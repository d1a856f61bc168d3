//! The hourly price annotation (`capi-autoscaler-provider/hourly-price`).
//!
//! Contract: no panic; absent → no price; an accepted price is a plain non-negative decimal (`12`, `0.096`,
//! `.5`), finite, and equal to the decimal it spells; a problem names the object and the annotation.
#![no_main]

use capi_autoscaler_provider::capi::{Labels, PRICE_ANNOTATION};
use capi_autoscaler_provider::pricing::group_price;
use capi_autoscaler_provider_fuzz::{annotation_field, annotations};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "MachinePool ns/mp";
const TOKENS: &[&str] = &[
    "0",
    "1",
    "5",
    "096",
    "9",
    ".",
    "-",
    "+",
    "e",
    "E",
    "inf",
    "nan",
    " ",
    "\n",
    "1e308",
    "0x1",
    "_",
    "999999999999999999999999999999999999999",
];

fn run(u: &mut Unstructured) -> Result<()> {
    let ann = annotations(u, &[PRICE_ANNOTATION], TOKENS)?;
    match group_price(OBJECT, &Labels::from(ann.clone())) {
        Ok(None) => assert!(!ann.contains_key(PRICE_ANNOTATION)),
        Ok(Some(v)) => {
            let raw = ann[PRICE_ANNOTATION].trim();
            assert!(v.is_finite() && v >= 0.0, "{raw:?} → {v}");
            assert!(
                raw.bytes().all(|b| b.is_ascii_digit() || b == b'.')
                    && raw.matches('.').count() <= 1,
                "{raw:?} accepted"
            );
            assert_eq!(raw.parse::<f64>().ok(), Some(v), "{raw:?}");
        }
        Err(p) => {
            assert_eq!(p.object, OBJECT);
            assert_eq!(p.field, annotation_field(PRICE_ANNOTATION));
            let raw = ann[PRICE_ANNOTATION].trim();
            let plain = !raw.is_empty()
                && raw.bytes().all(|b| b.is_ascii_digit() || b == b'.')
                && raw.matches('.').count() <= 1
                && raw != ".";
            // A plain decimal is rejected only when it does not fit a float.
            assert!(
                !plain || raw.parse::<f64>().is_ok_and(|v| !v.is_finite()),
                "{raw:?} rejected: {p:?}"
            );
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
