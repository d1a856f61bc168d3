//! Kubernetes name syntax (k8s.io/apimachinery/pkg/util/validation): label keys and values, DNS-1123
//! labels and subdomains. The `check_*` reasons complete a sentence that starts with the offending text.

const QUALIFIED_NAME_MAX: usize = 63;
const LABEL_VALUE_MAX: usize = 63;
const DNS1123_LABEL_MAX: usize = 63;
const DNS1123_SUBDOMAIN_MAX: usize = 253;

/// `IsQualifiedName`: `[prefix/]name`, prefix a DNS-1123 subdomain, name ≤ 63 characters of
/// alphanumerics, `-`, `_`, `.`, starting and ending with an alphanumeric.
pub fn check_qualified_name(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        None => (None, key),
        Some((prefix, name)) => (Some(prefix), name),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Err("has an empty prefix before '/'".into());
        }
        check_dns1123_subdomain(prefix).map_err(|why| format!("has a prefix that {why}"))?;
    }
    if name.is_empty() {
        return Err("has an empty name part".into());
    }
    if name.contains('/') {
        return Err("has more than one '/'".into());
    }
    if name.chars().count() > QUALIFIED_NAME_MAX {
        return Err(format!(
            "has a name part longer than {QUALIFIED_NAME_MAX} characters"
        ));
    }
    if !is_label_text(name) {
        return Err(format!("has a name part that {LABEL_TEXT_RULE}"));
    }
    Ok(())
}

/// `IsValidLabelValue`: empty, or ≤ 63 characters of alphanumerics, `-`, `_`, `.`, starting and ending with
/// an alphanumeric.
pub fn check_label_value(value: &str) -> Result<(), String> {
    if value.chars().count() > LABEL_VALUE_MAX {
        return Err(format!("is longer than {LABEL_VALUE_MAX} characters"));
    }
    if !value.is_empty() && !is_label_text(value) {
        return Err(LABEL_TEXT_RULE.to_string());
    }
    Ok(())
}

const LABEL_TEXT_RULE: &str = "must consist of alphanumeric characters, '-', '_' or '.', \
                               and must start and end with an alphanumeric character";

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_label_text(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn check_dns1123_label(s: &str) -> Result<(), String> {
    if s.len() > DNS1123_LABEL_MAX {
        return Err(format!("is longer than {DNS1123_LABEL_MAX} characters"));
    }
    if !is_dns1123_label(s) {
        return Err(
            "must be a DNS-1123 label: lowercase alphanumeric characters or '-', \
                    starting and ending with an alphanumeric character"
                .into(),
        );
    }
    Ok(())
}

fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= DNS1123_LABEL_MAX
        && ok(&b[0])
        && ok(&b[b.len() - 1])
        && b.iter().all(|c| ok(c) || *c == b'-')
}

/// Dot-separated DNS-1123 labels, at most 253 characters.
pub fn check_dns1123_subdomain(s: &str) -> Result<(), String> {
    if s.len() > DNS1123_SUBDOMAIN_MAX {
        return Err(format!("is longer than {DNS1123_SUBDOMAIN_MAX} characters"));
    }
    if !s.split('.').all(is_dns1123_label) {
        return Err(
            "must be a DNS-1123 subdomain: lowercase alphanumeric characters, '-' or '.', \
                    starting and ending with an alphanumeric character"
                .into(),
        );
    }
    Ok(())
}

pub fn is_qualified_name(s: &str) -> bool {
    check_qualified_name(s).is_ok()
}

pub fn is_label_value(s: &str) -> bool {
    check_label_value(s).is_ok()
}

pub fn is_dns1123_subdomain(s: &str) -> bool {
    check_dns1123_subdomain(s).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validators() {
        for ok in ["a", "a-b", "0", "a1", &"z".repeat(63)] {
            assert!(check_dns1123_label(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"z".repeat(64)] {
            assert!(check_dns1123_label(bad).is_err(), "{bad:?}");
        }
        for ok in ["a", "a.b", "cluster.x-k8s.io", "1.2.3"] {
            assert!(check_dns1123_subdomain(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "a.", ".a", "a..b", "A.b", "a_b.c"] {
            assert!(check_dns1123_subdomain(bad).is_err(), "{bad:?}");
        }
        for ok in ["", "a", "A.b_c-D", "1", &"v".repeat(63)] {
            assert!(check_label_value(ok).is_ok(), "{ok:?}");
        }
        for bad in [" ", "a b", "_a", "a.", "é", &"v".repeat(64)] {
            assert!(check_label_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn syntax_helpers() {
        for ok in [
            "a",
            "node-role.kubernetes.io/worker",
            "example.com/A_b.c-1",
            "x/y",
        ] {
            assert!(is_qualified_name(ok), "{ok}");
        }
        for bad in [
            "",
            "/a",
            "a/",
            "A.com/x",
            "a b",
            "-a",
            "a-",
            "a/b/c",
            &"x".repeat(64),
            "ex_ample.com/a",
        ] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
        for ok in ["", "a", "a.b-c_d", &"x".repeat(63)] {
            assert!(is_label_value(ok), "{ok}");
        }
        for bad in ["-a", "a-", "a/b", "a b", &"x".repeat(64), "é"] {
            assert!(!is_label_value(bad), "{bad}");
        }
    }
}
