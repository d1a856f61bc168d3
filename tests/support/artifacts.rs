//! The upstream artifacts the tests, the demo and the benchmarks run (cluster-autoscaler releases, the official
//! cluster-autoscaler chart, upstream's externalgrpc example server), as paths resolved by
//! `tests/upstream/artifact.sh`: a path from the environment, else a local mirror of upstream artifacts
//! (`CAPI_SHARED_UPSTREAM`, else `../shared/upstream` when it exists), else the public source, pinned by digest,
//! verified and cached (that script's header says which variable and which source for each).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// The resolver script.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/upstream/artifact.sh")
}

/// Runs the resolver with `args` (e.g. `["cluster-autoscaler", "1.35.2"]`): the path it prints, or what it said
/// on failure.
pub fn resolve(args: &[&str]) -> Result<PathBuf, String> {
    let script = script();
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run {}: {e}", script.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "{} {args:?}: {}\n{stderr}",
            script.display(),
            out.status
        ));
    }
    // Progress (a pull, a build) is worth seeing once; the path is the last line of stdout.
    eprint!("{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().last().map(str::trim) {
        Some(path) if !path.is_empty() => Ok(PathBuf::from(path)),
        _ => Err(format!(
            "{} {args:?} printed no path\n{stderr}",
            script.display()
        )),
    }
}

/// [`resolve`], once per `args` in this process; panics with the resolver's explanation when the artifact
/// cannot be had.
pub fn resolved(args: &[&str]) -> PathBuf {
    static FOUND: Mutex<Vec<(Vec<String>, PathBuf)>> = Mutex::new(Vec::new());
    let key: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = found.iter().find(|(k, _)| *k == key) {
        return path.clone();
    }
    let path = resolve(args).unwrap_or_else(|e| panic!("no upstream artifact {args:?}: {e}"));
    found.push((key, path.clone()));
    path
}
