"""Adapters of DRA mode: the kubelet's DRA and plugin-registration gRPC edges,
CDI spec files, claim records, and the resource.k8s.io/v1 API (ResourceSlice
publisher, ResourceClaim cache)."""
