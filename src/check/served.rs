//! Where the `check` report comes from: the running provider's `/check` answer when it serves the
//! same configuration (no second cache in its container), else watches of our own.

use std::time::Duration;

use serde::Serialize;

use super::{render_table, report};
use crate::config::{Config, ConnectionArgs, ServerArgs};
use crate::snapshot::Snapshot;
use crate::startup::read_only_snapshot;

/// What the running provider answers on `/check`: the report of its snapshot, rendered both ways,
/// and the configuration it serves, so a command of another configuration does not take it.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct ServedCheck {
    pub fingerprint: String,
    pub problems: usize,
    pub table: String,
    pub report: serde_json::Value,
}

/// Identifies what a provider serves: the validated configuration (clusters, discovery, Cluster,
/// group, version, prices), hashed (FNV-1a 64). Equal in `serve` and in a command run in its
/// container with the same environment.
pub fn fingerprint(config: &Config) -> String {
    let text = format!("{config:?}");
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// The `/check` answer of a snapshot.
pub fn served_check(snapshot: &Snapshot, fingerprint: &str) -> ServedCheck {
    let report = report(snapshot);
    ServedCheck {
        fingerprint: fingerprint.to_string(),
        problems: report.problems.len(),
        table: render_table(&report),
        report: serde_json::to_value(&report).unwrap_or_default(),
    }
}

/// The report, from the running provider when it answers for this configuration, else from watches
/// of our own. The second value says which, for a person (stderr) and for `explain`.
pub async fn served_or_own(
    connection: &ConnectionArgs,
    server: &ServerArgs,
) -> anyhow::Result<(ServedCheck, String)> {
    let config = connection.config()?;
    let fingerprint = fingerprint(&config);
    let address = server.metrics_address.trim();
    let why = if address.is_empty() {
        "--metrics-address is empty".to_string()
    } else {
        match ask_server(address).await {
            Ok(served) if served.fingerprint == fingerprint => {
                return Ok((served, format!("the running provider at {address}")));
            }
            Ok(_) => format!("the provider at {address} serves another configuration"),
            Err(e) => format!("no running provider at {address}: {e}"),
        }
    };
    let snapshot = read_only_snapshot(connection).await?;
    Ok((
        served_check(&snapshot, &fingerprint),
        format!("watches of its own ({why})"),
    ))
}

/// How long the running provider may take to answer: it answers from memory.
const SERVER_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest `/check` answer read.
const SERVER_ANSWER_LIMIT: u64 = 256 << 20;

/// `GET /check` on the provider's HTTP listener (plain HTTP/1.0 on loopback, as the listener serves).
async fn ask_server(address: &str) -> Result<ServedCheck, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| e.to_string())?;
        stream
            .write_all(format!("GET /check HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        stream
            .take(SERVER_ANSWER_LIMIT)
            .read_to_end(&mut answer)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<Vec<u8>, String>(answer)
    };
    let answer = tokio::time::timeout(SERVER_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {SERVER_TIMEOUT:?}"))??;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("not an HTTP answer")?;
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        let first = body.lines().next().unwrap_or_default();
        return Err(format!(
            "HTTP {status}: {}",
            crate::problem::cut(first, 200)
        ));
    }
    serde_json::from_str(body).map_err(|e| format!("not a check answer: {e}"))
}
