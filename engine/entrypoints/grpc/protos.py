"""The service's messages and stubs, built from the shipped xlaserve_grpc.proto when first asked for
(grpcio-tools compiles it in memory), so no generated code is kept beside the .proto to drift from it.
A Python client uses the same: `pb, services = protos_and_services()`, then
`services.GenerationStub(channel)` (README: gRPC)."""

from __future__ import annotations

import functools
import os
import sys

PROTO_FILE = os.path.join(os.path.dirname(__file__), "xlaserve_grpc.proto")


@functools.cache
def protos_and_services():
    """(messages module, services module) of xlaserve_grpc.proto: `pb.GenerateRequest`, ...,
    `services.GenerationStub`, `services.add_GenerationServicer_to_server`."""
    try:
        import grpc
        import grpc_tools  # noqa: F401 - grpc.protos_and_services needs it
    except ImportError as e:
        raise ImportError(
            "gRPC needs the grpc extra: pip install 'xlaserve[grpc]' (grpcio, grpcio-tools, "
            "grpcio-health-checking, grpcio-reflection)"
        ) from e
    # grpc resolves the .proto from an entry of sys.path; an editable install has none for this folder.
    folder = os.path.dirname(PROTO_FILE)
    sys.path.insert(0, folder)
    try:
        return grpc.protos_and_services(os.path.basename(PROTO_FILE))
    finally:
        sys.path.remove(folder)
