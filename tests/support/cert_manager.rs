//! A stand-in for cert-manager, which does not run here: the Secrets that cert-manager would write for the
//! rendered `Certificate` objects, made with rcgen from what each Certificate asks for (common name,
//! dnsNames/ipAddresses, isCA, usages, issuer), in cert-manager's Secret layout (`kubernetes.io/tls` with
//! `tls.crt`, `tls.key` and `ca.crt`, the certificate of the issuing CA; a self-signed certificate is its
//! own `ca.crt`). Only the two issuer kinds deploy/ uses are understood: `selfSigned` and `ca`.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use serde_json::Value;

/// What was issued, by Secret name: the PEM certificate (and the CA's, for `ca.crt`).
pub struct Issued {
    pub secrets: BTreeMap<String, IssuedSecret>,
}

pub struct IssuedSecret {
    pub cert: String,
    pub key: String,
    pub ca: String,
    /// The subject alternative names the certificate carries.
    pub names: Vec<String>,
}

struct CaIssuer {
    issuer: Issuer<'static, KeyPair>,
    cert: String,
}

/// Issues every `Certificate` among `objects` (all in `namespace`) and writes its Secret, as cert-manager
/// would once its Issuers are ready. Panics on an issuer kind it does not know or a dependency cycle.
pub async fn issue(client: &Client, namespace: &str, objects: &[Value]) -> Issued {
    let issuers: BTreeMap<String, &Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Issuer")
        .filter_map(|o| Some((o["metadata"]["name"].as_str()?.to_string(), &o["spec"])))
        .collect();
    let mut pending: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Certificate")
        .collect();
    // CA certificates by the Secret they are stored in (what a `ca` Issuer names).
    let mut cas: BTreeMap<String, CaIssuer> = BTreeMap::new();
    let mut issued = Issued {
        secrets: BTreeMap::new(),
    };
    while !pending.is_empty() {
        let before = pending.len();
        let mut waiting = Vec::new();
        for certificate in pending {
            let spec = &certificate["spec"];
            let name = certificate["metadata"]["name"].as_str().unwrap_or_default();
            let issuer_name = spec["issuerRef"]["name"].as_str().unwrap_or_default();
            assert!(
                spec["issuerRef"]["kind"].as_str().unwrap_or("Issuer") == "Issuer",
                "Certificate {name}: only namespaced Issuers are understood here"
            );
            let issuer = issuers
                .get(issuer_name)
                .unwrap_or_else(|| panic!("Certificate {name}: no Issuer {issuer_name}"));
            let secret_name = spec["secretName"]
                .as_str()
                .unwrap_or_else(|| panic!("Certificate {name} has no secretName"))
                .to_string();
            let (params, names) = params_of(name, spec);
            let key = KeyPair::generate().expect("generate a key");
            let (cert, ca_pem) = if issuer.get("selfSigned").is_some() {
                let cert = params.clone().self_signed(&key).expect("self-sign").pem();
                (cert.clone(), cert)
            } else if let Some(ca_secret) = issuer["ca"]["secretName"].as_str() {
                let Some(ca) = cas.get(ca_secret) else {
                    waiting.push(certificate);
                    continue;
                };
                let cert = params
                    .clone()
                    .signed_by(&key, &ca.issuer)
                    .expect("sign with the CA")
                    .pem();
                (cert, ca.cert.clone())
            } else {
                panic!("Issuer {issuer_name}: only selfSigned and ca issuers are understood here");
            };
            let key_pem = key.serialize_pem();
            write_secret(
                client,
                namespace,
                &secret_name,
                name,
                &cert,
                &key_pem,
                &ca_pem,
            )
            .await;
            if spec["isCA"] == true {
                cas.insert(
                    secret_name.clone(),
                    CaIssuer {
                        issuer: Issuer::new(params, key),
                        cert: cert.clone(),
                    },
                );
            }
            issued.secrets.insert(
                secret_name,
                IssuedSecret {
                    cert,
                    key: key_pem,
                    ca: ca_pem,
                    names,
                },
            );
        }
        assert!(
            waiting.len() < before,
            "Certificates waiting on CAs nobody issues: {:?}",
            waiting
                .iter()
                .map(|c| c["metadata"]["name"].clone())
                .collect::<Vec<_>>()
        );
        pending = waiting;
    }
    issued
}

fn params_of(name: &str, spec: &Value) -> (CertificateParams, Vec<String>) {
    let names: Vec<String> = ["dnsNames", "ipAddresses"]
        .iter()
        .filter_map(|k| spec[k].as_array())
        .flatten()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    let mut params = CertificateParams::new(names.clone())
        .unwrap_or_else(|e| panic!("Certificate {name}: subject alternative names: {e}"));
    let mut dn = DistinguishedName::new();
    if let Some(cn) = spec["commonName"].as_str() {
        dn.push(DnType::CommonName, cn);
    }
    params.distinguished_name = dn;
    if spec["isCA"] == true {
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
    } else {
        // cert-manager's default usages are "digital signature" and "key encipherment".
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.use_authority_key_identifier_extension = true;
    }
    for usage in spec["usages"].as_array().into_iter().flatten() {
        match usage.as_str().unwrap_or_default() {
            "server auth" => params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth),
            "client auth" => params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ClientAuth),
            "digital signature" | "key encipherment" | "cert sign" => {}
            other => panic!("Certificate {name}: usage {other:?} is not understood here"),
        }
    }
    (params, names)
}

async fn write_secret(
    client: &Client,
    namespace: &str,
    secret_name: &str,
    certificate: &str,
    cert: &str,
    key: &str,
    ca: &str,
) {
    let data: BTreeMap<String, ByteString> = [("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
        .collect();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(secret_name.to_string()),
            namespace: Some(namespace.to_string()),
            annotations: Some(
                [(
                    "cert-manager.io/certificate-name".to_string(),
                    certificate.to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(
            secret_name,
            &PatchParams::apply("e2e-cert-manager").force(),
            &Patch::Apply(&secret),
        )
        .await
        .unwrap_or_else(|e| panic!("write Secret {namespace}/{secret_name}: {e}"));
}
