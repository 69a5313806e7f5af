"""gRPC entry point: `xlaserve.v1.Generation` (xlaserve_grpc.proto) beside the HTTP API."""
