//! Certificates for the test control plane, made with rcgen: a CA, the apiserver's serving
//! certificate, client certificates (the admin in `system:masters`, restricted users), the
//! service-account signing key, and kubeconfig files that embed them.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// A certificate and its private key, PEM encoded.
pub struct CertPem {
    pub cert: String,
    pub key: String,
}

/// The test CA. It stays in memory for the life of the test binary to sign more client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub cert_pem: String,
}

impl Ca {
    pub fn generate() -> Ca {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn("capi-e2e-ca", None);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("generate the CA key");
        let cert = params.self_signed(&key).expect("self-sign the CA");
        Ca {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
        }
    }

    /// A serving certificate for 127.0.0.1 and localhost.
    pub fn serving_cert(&self, common_name: &str) -> CertPem {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
            .expect("serving certificate SANs");
        params.distinguished_name = dn(common_name, None);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        self.sign(params)
    }

    /// A client certificate: the apiserver sees user `common_name` in group `organization`.
    pub fn client_cert(&self, common_name: &str, organization: Option<&str>) -> CertPem {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(common_name, organization);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> CertPem {
        let key = KeyPair::generate().expect("generate a key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("sign a certificate with the test CA");
        CertPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

fn dn(common_name: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    if let Some(o) = organization {
        dn.push(DnType::OrganizationName, o);
    }
    dn.push(DnType::CommonName, common_name);
    dn
}

/// A private key (PKCS#8 PEM) for signing service-account tokens, and its public key (SPKI PEM).
pub fn service_account_key() -> (String, String) {
    let key = KeyPair::generate().expect("generate the service-account key");
    (key.serialize_pem(), key.public_key_pem())
}

/// Writes `contents` to `dir/name` (owner-only permissions) and returns the path.
pub fn write_private(dir: &Path, name: &str, contents: &str) -> PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    std::io::Write::write_all(&mut file, contents.as_bytes())
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// A self-contained kubeconfig (certificates embedded) for `user` at `server`.
pub fn kubeconfig(server: &str, ca_pem: &str, user: &str, client: &CertPem) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: {user}@e2e
  context:
    cluster: e2e
    user: {user}
current-context: {user}@e2e
",
        ca = STANDARD.encode(ca_pem),
        cert = STANDARD.encode(&client.cert),
        key = STANDARD.encode(&client.key),
    )
}
