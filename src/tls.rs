//! TLS of the gRPC listener: the server certificate and key and, for mutual TLS, the client CA bundle,
//! read from files and read again when they change. cert-manager renews certificates in place (the
//! kubelet swaps the Secret's files under the mounted volume); every connection accepted after a change
//! is served with the new files, connections already open keep the session they have.
//!
//! The files are looked at every [`POLL`]: their size, modification time and inode. A set that does not
//! load (a key that does not match its certificate, half of a rotation written) keeps the previous one
//! in use; the error is logged once and counted in `capi_autoscaler_provider_tls_reloads_total`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use futures::Stream;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;

use crate::metrics::Metrics;

/// How often the files are looked at.
pub const POLL: Duration = Duration::from_secs(1);

/// A handshake not finished within this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at most; connections beyond are closed at once.
const MAX_HANDSHAKES: usize = 256;

/// What tells a file changed: size, modification time, inode, device; `None` when it cannot be looked at.
type Stamp = Vec<Option<(u64, SystemTime, u64, u64)>>;

/// Why the TLS files do not make a server configuration; each names the flag and file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {}: {source}", path.display())]
    Pem {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: pem::Error,
    },
    #[error("{flag} {}: no PEM certificate in the file", path.display())]
    NoCertificate { flag: &'static str, path: PathBuf },
    #[error("TLS protocol versions: {0}")]
    ProtocolVersions(#[source] rustls::Error),
    /// A certificate of the client CA bundle is not a usable trust anchor.
    #[error("--tls-client-ca {}: {source}", path.display())]
    ClientCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("--tls-client-ca {}: {source}", path.display())]
    ClientVerifier {
        path: PathBuf,
        #[source]
        source: VerifierBuilderError,
    },
    /// The key does not go with the certificate, or is of a kind not supported.
    #[error("--tls-cert {} with --tls-key {}: {source}", cert.display(), key.display())]
    KeyPair {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// Where the TLS material is.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// With a client CA, clients must present a certificate it signed.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<(&'static str, &Path)> {
        let mut paths = vec![
            ("--tls-cert", self.cert.as_path()),
            ("--tls-key", self.key.as_path()),
        ];
        if let Some(ca) = &self.client_ca {
            paths.push(("--tls-client-ca", ca.as_path()));
        }
        paths
    }

    /// Size, modification time and inode of each file (following symlinks, as the kubelet's
    /// `..data` link is swapped); `None` for a file that cannot be looked at.
    fn stamp(&self) -> Stamp {
        self.paths()
            .into_iter()
            .map(|(_, path)| {
                std::fs::metadata(path).ok().map(|m| {
                    (
                        m.len(),
                        m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                        m.ino(),
                        m.dev(),
                    )
                })
            })
            .collect()
    }

    /// A server configuration from the files as they are now.
    pub fn load(&self) -> Result<ServerConfig, TlsError> {
        let read = |flag: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                flag,
                path: path.to_path_buf(),
                source,
            })
        };
        let pem = |flag: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| TlsError::Pem { flag, path, source }
        };
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&read("--tls-cert", &self.cert)?)
                .collect::<Result<_, _>>()
                .map_err(pem("--tls-cert", &self.cert))?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate {
                flag: "--tls-cert",
                path: self.cert.clone(),
            });
        }
        let key = PrivateKeyDer::from_pem_slice(&read("--tls-key", &self.key)?)
            .map_err(pem("--tls-key", &self.key))?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(TlsError::ProtocolVersions)?;
        let builder = match &self.client_ca {
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&read("--tls-client-ca", path)?) {
                    let cert = cert.map_err(pem("--tls-client-ca", path))?;
                    roots.add(cert).map_err(|source| TlsError::ClientCa {
                        path: path.clone(),
                        source,
                    })?;
                }
                if roots.is_empty() {
                    return Err(TlsError::NoCertificate {
                        flag: "--tls-client-ca",
                        path: path.clone(),
                    });
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|source| TlsError::ClientVerifier {
                            path: path.clone(),
                            source,
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config =
            builder
                .with_single_cert(certs, key)
                .map_err(|source| TlsError::KeyPair {
                    cert: self.cert.clone(),
                    key: self.key.clone(),
                    source,
                })?;
        // gRPC is HTTP/2 only; grpc-go clients (CA) insist on ALPN saying so.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// The current server configuration, replaced when the files change.
pub struct ReloadingTls {
    files: TlsFiles,
    config: ArcSwap<ServerConfig>,
    /// The stamp of the files last tried, and whether that try failed.
    last: Mutex<(Stamp, bool)>,
    metrics: Arc<Metrics>,
}

impl ReloadingTls {
    /// Loads the files; an error here stops the start.
    pub fn new(files: TlsFiles, metrics: Arc<Metrics>) -> Result<Arc<Self>, TlsError> {
        let stamp = files.stamp();
        let config = files.load()?;
        Ok(Arc::new(ReloadingTls {
            files,
            config: ArcSwap::from_pointee(config),
            last: Mutex::new((stamp, false)),
            metrics,
        }))
    }

    /// Loads the files again if they changed since the last look; true when a new configuration is in use.
    pub fn reload_if_changed(&self) -> bool {
        let stamp = self.files.stamp();
        let mut last = crate::lock(&self.last);
        if last.0 == stamp {
            return false;
        }
        match self.files.load() {
            Ok(config) => {
                self.config.store(Arc::new(config));
                *last = (stamp, false);
                self.metrics.tls_reload("success");
                tracing::info!(files = ?self.files.paths().iter().map(|(_, p)| p.display().to_string()).collect::<Vec<_>>(), "TLS files changed: new connections use them");
                true
            }
            Err(e) => {
                // Half of a rotation may be written: try again at the next change, keep serving the
                // previous files meanwhile.
                if !last.1 {
                    tracing::warn!(
                        "TLS files changed but do not load, still serving the previous ones: {e}"
                    );
                }
                *last = (stamp, true);
                self.metrics.tls_reload("error");
                false
            }
        }
    }

    /// Looks at the files every [`POLL`] for as long as the server runs.
    pub fn spawn_poll(self: &Arc<Self>) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // Reading a few small files: off the async threads all the same.
                let me = Arc::clone(&me);
                let _ = tokio::task::spawn_blocking(move || me.reload_if_changed()).await;
            }
        });
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.load_full())
    }

    /// Accepts connections on `listener` and hands them over once their handshake is done, each
    /// with the configuration current when it was accepted. Handshakes run side by side (a slow
    /// client holds up nobody), at most [`MAX_HANDSHAKES`] at a time and each for at most
    /// [`HANDSHAKE_TIMEOUT`].
    pub fn incoming(
        self: &Arc<Self>,
        listener: TcpListener,
    ) -> impl Stream<Item = Result<TlsStream<TcpStream>, std::io::Error>> + use<> {
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    () = tx.closed() => break,
                };
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: give the system a moment.
                        tracing::warn!("accepting a gRPC connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                    tracing::debug!(%peer, "too many TLS handshakes in progress; connection closed");
                    continue;
                };
                let acceptor = me.acceptor();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send(Ok(tls)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    fn files(dir: &Path) -> TlsFiles {
        TlsFiles {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            client_ca: None,
        }
    }

    #[test]
    fn a_missing_file_names_its_flag_and_keeps_the_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let files = files(dir.path());
        let error = files.load().unwrap_err();
        assert!(
            matches!(
                error,
                TlsError::Read {
                    flag: "--tls-cert",
                    ..
                }
            ),
            "{error:?}"
        );
        let io = error
            .source()
            .and_then(|e| e.downcast_ref::<std::io::Error>())
            .unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
        assert_eq!(
            error.to_string(),
            format!("--tls-cert {}: {io}", files.cert.display())
        );
    }

    #[test]
    fn a_file_without_a_certificate_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let files = files(dir.path());
        std::fs::write(&files.cert, "not PEM at all\n").unwrap();
        let error = files.load().unwrap_err();
        assert!(error.source().is_none(), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!(
                "--tls-cert {}: no PEM certificate in the file",
                files.cert.display()
            )
        );
    }
}
