//! A node group's size bounds, from the autoscaler's min/max size annotations on its scalable
//! resource (the rule upstream's Cluster API provider follows).

use super::Labels;

use super::{Keys, ParseError, ScalableResource};

/// Whether a resource carries a bound annotation, valid or not: it is meant to be a node group.
pub fn has_bounds(keys: &Keys, resource: &ScalableResource) -> bool {
    resource.annotations.contains_key(&keys.min_size)
        || resource.annotations.contains_key(&keys.max_size)
}

/// min/max from the annotations. `Ok(None)`: neither annotation, not a candidate. An error names the
/// annotation that is wrong (the max size one when it is missing or below min).
pub fn scaling_bounds(keys: &Keys, annotations: &Labels) -> Result<Option<(i32, i32)>, ParseError> {
    let field = |key: &str| format!("metadata.annotations[{key}]");
    let read = |key: &str| -> Result<Option<i32>, ParseError> {
        match annotations.get(key) {
            None => Ok(None),
            Some(v) => match v.trim().parse::<i32>() {
                Ok(n) if n >= 0 => Ok(Some(n)),
                Ok(n) => Err(ParseError::new(field(key), format!("{n} is negative"))),
                Err(_) => Err(ParseError::new(
                    field(key),
                    format!("{v:?} is not a non-negative integer"),
                )),
            },
        }
    };
    let min = read(&keys.min_size)?;
    let max = read(&keys.max_size)?;
    match (min, max) {
        (None, None) => Ok(None),
        (_, None) => Err(ParseError::new(
            field(&keys.max_size),
            "missing: the min size annotation is set but the max size annotation is not",
        )),
        (min, Some(max)) => {
            let min = min.unwrap_or(0);
            if max < min {
                Err(ParseError::new(
                    field(&keys.max_size),
                    format!("max size {max} is below min size {min}"),
                ))
            } else {
                Ok(Some((min, max)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_bounds_follow_upstream_rules() {
        let k = Keys::default();
        let ann = |min: Option<&str>, max: Option<&str>| {
            let mut a = Labels::default();
            if let Some(v) = min {
                a.insert(k.min_size.clone(), v.to_string());
            }
            if let Some(v) = max {
                a.insert(k.max_size.clone(), v.to_string());
            }
            a
        };
        assert_eq!(scaling_bounds(&k, &ann(None, None)), Ok(None));
        assert_eq!(scaling_bounds(&k, &ann(None, Some("3"))), Ok(Some((0, 3))));
        assert_eq!(
            scaling_bounds(&k, &ann(Some("2"), Some("2"))),
            Ok(Some((2, 2)))
        );
        assert!(scaling_bounds(&k, &ann(Some("x"), Some("2"))).is_err());
        assert!(scaling_bounds(&k, &ann(Some("3"), Some("2"))).is_err());
        assert!(scaling_bounds(&k, &ann(Some("1"), None)).is_err());
    }

    #[test]
    fn a_bound_error_names_the_annotation_at_fault() {
        let k = Keys::default();
        let only_min: Labels = [(k.min_size.clone(), "1")].into_iter().collect();
        let missing_max = scaling_bounds(&k, &only_min).expect_err("max is missing");
        assert_eq!(
            missing_max.field,
            format!("metadata.annotations[{}]", k.max_size)
        );
        let negative: Labels = [(k.min_size.clone(), "-1"), (k.max_size.clone(), "3")]
            .into_iter()
            .collect();
        let error = scaling_bounds(&k, &negative).expect_err("min is negative");
        assert_eq!(error.field, format!("metadata.annotations[{}]", k.min_size));
        assert_eq!(error.message, "-1 is negative");
    }
}
