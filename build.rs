//! Compiles proto/externalgrpc.proto with a pure-Rust protobuf compiler, so no system protoc is needed;
//! writes its encoded descriptor set for gRPC server reflection; and records the git commit the binary
//! is built from (`BUILD_GIT_COMMIT` when set, as in the Dockerfile whose context has no `.git`; else
//! `git rev-parse HEAD`; else "unknown": a build never fails for want of git).

use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/externalgrpc.proto";
    // Once any rerun-if-changed is printed, cargo watches only what is printed: this script too.
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // With imports (the well-known types) included: reflection clients resolve every type from it.
    std::fs::write(
        out_dir.join("externalgrpc_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        // prost's, but a request that carries nodes is measured before it is decoded.
        .codec_path("crate::grpc::codec::ScreenedCodec")
        .build_client(true)
        .build_server(true)
        // Hand-written in src/proto.rs: answered from bytes encoded once per group change.
        .extern_path(
            ".clusterautoscaler.cloudprovider.v1.externalgrpc.NodeGroupsResponse",
            "crate::proto::NodeGroupsResponse",
        )
        .extern_path(
            ".clusterautoscaler.cloudprovider.v1.externalgrpc.NodeGroupForNodeResponse",
            "crate::proto::NodeGroupForNodeResponse",
        )
        // Shared, not copied, by every answer of the same template.
        .bytes(".clusterautoscaler.cloudprovider.v1.externalgrpc.NodeGroupTemplateNodeInfoResponse")
        .compile_fds(descriptors)?;

    println!("cargo:rerun-if-env-changed=BUILD_GIT_COMMIT");
    let commit = match std::env::var("BUILD_GIT_COMMIT") {
        Ok(commit) if !commit.trim().is_empty() => commit.trim().to_string(),
        _ => git_commit().unwrap_or_else(|| "unknown".to_string()),
    };
    println!("cargo:rustc-env=CAPI_AUTOSCALER_PROVIDER_GIT_COMMIT={commit}");
    Ok(())
}

/// HEAD's commit, and rerun-if-changed on the files that move when HEAD does (only paths that exist:
/// a missing one would make cargo rerun this script, and rebuild the crate, on every build).
fn git_commit() -> Option<String> {
    let commit = git(&["rev-parse", "HEAD"])?;
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])?];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.extend(git(&["rev-parse", "--git-path", &branch]));
    }
    watched.extend(git(&["rev-parse", "--git-path", "packed-refs"]));
    for path in watched {
        // `--git-path` answers relative to the working directory, which cargo sets to the manifest's.
        // A branch whose ref is packed has no file yet, and the next commit creates one: watch the
        // nearest existing directory then (cargo notices files added below it).
        let mut path = Path::new(&path);
        while !path.exists() {
            match path.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => path = parent,
                _ => break,
            }
        }
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    let valid = commit.len() >= 7 && commit.bytes().all(|b| b.is_ascii_hexdigit());
    valid.then_some(commit)
}

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}
