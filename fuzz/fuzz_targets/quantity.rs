//! Kubernetes quantities (`capacity.cluster-autoscaler.kubernetes.io/{cpu,memory,ephemeral-disk}`, an
//! infrastructure template's `status.capacity`, pod requests in PricingPodPrice).
//!
//! Contract: no panic; an accepted quantity is Go's grammar, finite, not negative, and its value is the
//! mantissa × the suffix's factor (compared with an independent float computation); a quantity in Go's
//! grammar of a sane size (at most 1e24, exponent within ±30) is accepted; an error quotes the input.
#![no_main]

use capi_autoscaler_provider::capi::quantity::parse_quantity;
use libfuzzer_sys::fuzz_target;

/// Go's `resource.ParseQuantity` grammar, evaluated in floating point: `None` when the text is not a
/// quantity; the exponent of an `e` suffix, when there is one.
fn reference(s: &str) -> Option<(f64, Option<i64>)> {
    let b = s.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let start = i;
    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
        i += 1;
    }
    let number = &s[start..i];
    if number.matches('.').count() > 1 || !number.bytes().any(|c| c.is_ascii_digit()) {
        return None;
    }
    let mantissa: f64 = number.parse().ok()?;
    let mantissa = if b.first() == Some(&b'-') {
        -mantissa
    } else {
        mantissa
    };
    let binary = |p: i32| 2f64.powi(p);
    let (factor, exponent) = match &s[i..] {
        "" => (1.0, None),
        "Ki" => (binary(10), None),
        "Mi" => (binary(20), None),
        "Gi" => (binary(30), None),
        "Ti" => (binary(40), None),
        "Pi" => (binary(50), None),
        "Ei" => (binary(60), None),
        "n" => (1e-9, None),
        "u" => (1e-6, None),
        "m" => (1e-3, None),
        "k" => (1e3, None),
        "M" => (1e6, None),
        "G" => (1e9, None),
        "T" => (1e12, None),
        "P" => (1e15, None),
        "E" => (1e18, None),
        other => {
            let digits = other.strip_prefix(['e', 'E'])?;
            let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(digits);
            if unsigned.is_empty() || !unsigned.bytes().all(|c| c.is_ascii_digit()) {
                return None;
            }
            // Go reads the exponent as an int64.
            let e: i64 = digits.parse().ok()?;
            (10f64.powi(e.clamp(-400, 400) as i32), Some(e))
        }
    };
    // NaN: too large or too small for floating point to tell (e.g. 1e400e-500); not compared.
    let value = match (mantissa, factor) {
        (0.0, _) => 0.0,
        (m, f) if m.is_finite() && f.is_finite() && f != 0.0 => m * f,
        _ => f64::NAN,
    };
    Some((value, exponent))
}

fuzz_target!(|raw: &str| {
    let got = parse_quantity(raw);
    let s = raw.trim();
    let reference = reference(s);
    match &got {
        Ok(v) => {
            assert!(v.is_finite() && *v >= 0.0, "{raw:?} gave {v}");
            let (want, _) =
                reference.unwrap_or_else(|| panic!("{raw:?} accepted, not Go's grammar"));
            let tolerance = 1e-9 + want.abs() * 1e-9;
            assert!(
                want.is_nan() || (v - want).abs() <= tolerance,
                "{raw:?} gave {v}, want {want}"
            );
        }
        Err(e) => {
            let e = e.to_string();
            assert!(!e.is_empty());
            if !s.is_empty() {
                assert!(e.contains(&format!("{s:?}")), "{e:?} does not quote {s:?}");
            }
            if let Some((want, exponent)) = reference {
                let sane = (0.0..=1e24).contains(&want)
                    && exponent.is_none_or(|e| (-30..=30).contains(&e))
                    && s.len() <= 20;
                assert!(!sane, "{raw:?} ({want}) rejected: {e}");
            }
        }
    }
});
