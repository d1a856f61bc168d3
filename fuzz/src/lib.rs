//! Shared by the fuzz targets in `fuzz_targets/`: inputs built from the fuzzer's bytes (text made mostly of
//! the tokens of the grammar under test, annotation maps over the keys a parser reads) and the reference
//! spellings the contracts compare with.
//!
//! libFuzzer mutates bytes; without a sanitizer runtime it cannot see string comparisons, so structured
//! targets draw whole tokens (`4Gi`, `NoSchedule`, `autoscaling-options-…`) from the bytes instead of
//! waiting for the fuzzer to spell them.

use std::collections::BTreeMap;

use arbitrary::{Result, Unstructured};

/// Text of up to `max_pieces` pieces: mostly tokens from `tokens`, sometimes raw fuzz text.
pub fn text_of(u: &mut Unstructured, tokens: &[&str], max_pieces: usize) -> Result<String> {
    let mut s = String::new();
    for _ in 0..u.int_in_range(0..=max_pieces)? {
        if !tokens.is_empty() && u.ratio(7, 8)? {
            s.push_str(u.choose(tokens)?);
        } else {
            let raw: &str = u.arbitrary()?;
            s.push_str(raw);
        }
    }
    Ok(s)
}

/// [`text_of`] with up to 8 pieces.
pub fn text(u: &mut Unstructured, tokens: &[&str]) -> Result<String> {
    text_of(u, tokens, 8)
}

/// An annotation map: keys mostly from `keys` (sometimes made up), values from [`text`] over `tokens`.
pub fn annotations(
    u: &mut Unstructured,
    keys: &[&str],
    tokens: &[&str],
) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=keys.len() + 2)? {
        let key = if keys.is_empty() || u.ratio(1, 10)? {
            text_of(u, &["cluster.x-k8s.io/", "example.com/", "a", "-"], 3)?
        } else {
            u.choose(keys)?.to_string()
        };
        out.insert(key, text(u, tokens)?);
    }
    Ok(out)
}

/// Go's `time.Duration.String()`: `1h2m3.5s`, `1.5µs`, `-2m0s`, `0s`.
pub fn go_duration_string(d: i64) -> String {
    fn frac(v: u64, prec: usize) -> String {
        if v == 0 {
            return String::new();
        }
        let digits = format!("{v:0prec$}");
        format!(".{}", digits.trim_end_matches('0'))
    }
    if d == 0 {
        return "0s".to_string();
    }
    let sign = if d < 0 { "-" } else { "" };
    let u = d.unsigned_abs();
    let body = if u < 1_000_000_000 {
        let (prec, unit) = match u {
            0..1_000 => (0, "ns"),
            1_000..1_000_000 => (3, "µs"),
            _ => (6, "ms"),
        };
        let scale = 10u64.pow(prec as u32);
        format!("{}{}{unit}", u / scale, frac(u % scale, prec))
    } else {
        let fraction = frac(u % 1_000_000_000, 9);
        let secs = u / 1_000_000_000;
        let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
        match (h, m) {
            (0, 0) => format!("{s}{fraction}s"),
            (0, _) => format!("{m}m{s}{fraction}s"),
            _ => format!("{h}h{m}m{s}{fraction}s"),
        }
    };
    format!("{sign}{body}")
}

/// The field path problems use for annotation `key`.
pub fn annotation_field(key: &str) -> String {
    capi_autoscaler_provider::problem::Problem::annotation_field(key)
}

#[cfg(test)]
mod tests {
    use super::go_duration_string as s;

    #[test]
    fn go_spellings() {
        assert_eq!(s(0), "0s");
        assert_eq!(s(1), "1ns");
        assert_eq!(s(1_500), "1.5µs");
        assert_eq!(s(2_000_000), "2ms");
        assert_eq!(s(90_000_000_000), "1m30s");
        assert_eq!(s(3_600_000_000_000), "1h0m0s");
        assert_eq!(s(-1_500_000_000), "-1.5s");
        assert_eq!(s(i64::MIN), "-2562047h47m16.854775808s");
        assert_eq!(s(i64::MAX), "2562047h47m16.854775807s");
    }
}
