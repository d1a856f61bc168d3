//! The externalgrpc wire types and service, generated from proto/externalgrpc.proto by build.rs.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("clusterautoscaler.cloudprovider.v1.externalgrpc");

/// The encoded `FileDescriptorSet` of proto/externalgrpc.proto and its imports, served by gRPC
/// reflection so that grpcurl and similar tools work without the .proto file.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("externalgrpc_descriptor");
