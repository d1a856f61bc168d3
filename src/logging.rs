//! The process's log: `RUST_LOG` filter, text or JSON lines (`LOG_FORMAT=json`) on stderr, fatal
//! errors included.

use std::io::IsTerminal;
use std::process::ExitCode;

/// Installs the global subscriber.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube_runtime=warn,kube_client=warn")
    });
    let no_color = std::env::var_os("NO_COLOR");
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(use_ansi(
            std::io::stderr().is_terminal(),
            no_color.as_deref().and_then(|v| v.to_str()),
        ))
        .with_writer(std::io::stderr);
    if json() {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
}

/// `LOG_FORMAT=json`: every line on stderr is a JSON object, a log collector parses each.
fn json() -> bool {
    std::env::var("LOG_FORMAT").is_ok_and(|f| f == "json")
}

/// Reports the error that ends the process: `error: …` with its causes, or with `LOG_FORMAT=json` an
/// error-level JSON line like every other (`fields.message`, and `fields.fatal` true).
pub fn fatal(e: &anyhow::Error) {
    if json() {
        tracing::error!(fatal = true, "{e:#}");
    } else {
        eprintln!("error: {e:#}");
    }
}

/// Reports a flag or environment value clap refused (or prints the help or version asked for) and
/// gives the exit code clap would: 2 for a usage error, 0 for `--help` and `--version`.
pub fn usage_error(e: &clap::Error) -> ExitCode {
    let code = ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
    if !e.use_stderr() || !json() {
        // --help and --version go to stdout as they are; a usage error in text mode as clap writes it.
        let _ = e.print();
        return code;
    }
    let text = e.render().to_string();
    let message = text.trim().trim_start_matches("error: ");
    tracing::error!(fatal = true, "{message}");
    code
}

/// Colours only for a person at a terminal: a pod's log, a file or a pipe would keep the escape codes
/// as noise. `NO_COLOR` (any non-empty value, see no-color.org) turns them off on a terminal too.
fn use_ansi(stderr_is_terminal: bool, no_color: Option<&str>) -> bool {
    stderr_is_terminal && no_color.is_none_or(str::is_empty)
}

#[cfg(test)]
mod tests {
    use super::use_ansi;

    #[test]
    fn colours_only_on_a_terminal_without_no_color() {
        assert!(use_ansi(true, None));
        assert!(use_ansi(true, Some("")));
        assert!(!use_ansi(true, Some("1")));
        assert!(!use_ansi(false, None));
    }
}
