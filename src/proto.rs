//! The externalgrpc wire types and service, generated from proto/externalgrpc.proto by build.rs.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("clusterautoscaler.cloudprovider.v1.externalgrpc");
