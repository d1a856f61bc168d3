//! Kubernetes quantities (`resource.ParseQuantity`): what Go accepts, as a number of cores, bytes or units.

use kube_quantity::{ParseQuantityError, ParsedQuantity};

/// Why a text is not a quantity Go would accept; each names the text (trimmed).
#[derive(Debug, thiserror::Error)]
pub enum QuantityError {
    #[error("empty quantity")]
    Empty,
    #[error("{0:?} is not a quantity (e.g. 4, 500m, 16Gi, 128G)")]
    Syntax(String),
    /// Go's grammar accepts it, the number does not parse.
    #[error("{value:?} is not a quantity: {source}")]
    Number {
        value: String,
        #[source]
        source: ParseQuantityError,
    },
    #[error("{0:?} is out of range")]
    OutOfRange(String),
    #[error("{0:?} is negative")]
    Negative(String),
}

/// Parses a Kubernetes quantity (`resource.ParseQuantity` syntax) into its value (cores, bytes, count).
/// The syntax is checked first so that only what Go accepts passes (the value then goes verbatim into the
/// node CA decodes with Go); negative values are rejected.
pub fn parse_quantity(raw: &str) -> Result<f64, QuantityError> {
    let s = raw.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    if !is_go_quantity(s) {
        return Err(QuantityError::Syntax(s.to_string()));
    }
    // kube_quantity takes neither exa suffix (`E` reads as an exponent, `Ei` fails): scale from peta.
    let (body, factor) = if let Some(b) = s.strip_suffix("Ei") {
        (format!("{b}Pi"), 1024.0)
    } else if let Some(b) = s.strip_suffix('E') {
        (format!("{b}P"), 1000.0)
    } else {
        (s.to_string(), 1.0)
    };
    let q = ParsedQuantity::try_from(body.as_str()).map_err(|source| QuantityError::Number {
        value: s.to_string(),
        source,
    })?;
    let v = q
        .to_bytes_f64()
        .map(|v| v * factor)
        .filter(|v| v.is_finite())
        .ok_or_else(|| QuantityError::OutOfRange(s.to_string()))?;
    if v < 0.0 {
        return Err(QuantityError::Negative(s.to_string()));
    }
    Ok(v)
}

/// Go's quantity grammar: `[+-]?(digits | digits.digits? | .digits)` then `""`, a binary suffix
/// (`Ki`..`Ei`), a decimal suffix (`n u m k M G T P E`) or an exponent `[eE][+-]?digits`.
fn is_go_quantity(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    if matches!(b.first(), Some(b'+' | b'-')) {
        i += 1;
    }
    let int_start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    let mut digits = i - int_start;
    if i < b.len() && b[i] == b'.' {
        i += 1;
        let frac_start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        digits += i - frac_start;
    }
    if digits == 0 {
        return false;
    }
    let suffix = &s[i..];
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        _ => {
            let Some(exp) = suffix.strip_prefix(['e', 'E']) else {
                return false;
            };
            let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            !exp.is_empty() && exp.bytes().all(|c| c.is_ascii_digit()) && exp.len() <= 18
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        let ok = [
            ("4", 4.0),
            ("500m", 0.5),
            ("0.1", 0.1),
            (".5", 0.5),
            ("5.", 5.0),
            ("+2", 2.0),
            ("16Gi", 16.0 * 1024.0 * 1024.0 * 1024.0),
            ("128G", 128e9),
            ("1024", 1024.0),
            ("1e3", 1000.0),
            ("1E3", 1000.0),
            ("2E", 2e18),
            ("1Ki", 1024.0),
            // found by fuzz/fuzz_targets/quantity.rs: kube_quantity rejects the `Ei` suffix
            ("1Ei", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
            (
                "1.5Ei",
                1.5 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
            ),
            (
                "3Ei",
                3.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
            ),
            (" 8 ", 8.0),
            ("0", 0.0),
        ];
        for (s, want) in ok {
            let got = parse_quantity(s);
            assert!(
                got.as_ref()
                    .is_ok_and(|v| (v - want).abs() <= want.abs() * 1e-12),
                "{s:?}: {got:?} != {want}"
            );
        }
        for s in [
            "", "Ki", "abc", "1.1.1", "1 Gi", "1KB", "-1", "-500m", "1e", "e3", "1e3.5", "inf",
            "nan", "0x10", "1gi", "1K",
        ] {
            assert!(parse_quantity(s).is_err(), "{s:?} accepted");
        }
    }

    /// The texts problems quote (`check` prints them): they name the trimmed value.
    #[test]
    fn errors_say_what_is_wrong_with_the_value() {
        let message = |s: &str| parse_quantity(s).unwrap_err().to_string();
        assert_eq!(message("  "), "empty quantity");
        assert_eq!(
            message(" 1KB "),
            r#""1KB" is not a quantity (e.g. 4, 500m, 16Gi, 128G)"#
        );
        assert_eq!(message("-500m"), r#""-500m" is negative"#);
    }
}
