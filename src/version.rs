//! What this binary is: its version and the git commit it was built from (build.rs), for the start-up
//! log, the `capi_autoscaler_provider_build_info` metric, `--version` and the User-Agent.

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit the binary was built from, or "unknown" (built without git and without
/// `BUILD_GIT_COMMIT`).
pub const COMMIT: &str = env!("CAPI_AUTOSCALER_PROVIDER_GIT_COMMIT");

/// `--version`: the version and the commit.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("CAPI_AUTOSCALER_PROVIDER_GIT_COMMIT"),
    ")"
);

/// Sent on every Kubernetes API request, so the apiserver's audit log, its default field manager and
/// its metrics attribute our traffic to us.
pub const USER_AGENT: &str = concat!("capi-autoscaler-provider/", env!("CARGO_PKG_VERSION"));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_agent_is_name_slash_version() {
        assert_eq!(USER_AGENT, format!("capi-autoscaler-provider/{VERSION}"));
        assert!(http::HeaderValue::from_str(USER_AGENT).is_ok());
    }

    #[test]
    fn the_commit_is_a_hash_or_unknown() {
        // Built from this repository's work tree (or with BUILD_GIT_COMMIT): a hex hash.
        assert!(
            COMMIT == "unknown" || COMMIT.bytes().all(|b| b.is_ascii_hexdigit()),
            "{COMMIT}"
        );
        assert!(LONG_VERSION.starts_with(VERSION) && LONG_VERSION.contains(COMMIT));
    }

    #[test]
    fn the_changelog_names_this_version_first() {
        let changelog = include_str!("../CHANGELOG.md");
        let first = changelog
            .lines()
            .find_map(|l| l.strip_prefix("## "))
            .expect("CHANGELOG.md has a release heading");
        assert_eq!(
            first.split_whitespace().next(),
            Some(VERSION),
            "CHANGELOG.md's newest release is not Cargo.toml's version"
        );
    }
}
