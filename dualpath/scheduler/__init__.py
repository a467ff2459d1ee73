"""The scheduler and control plane (paper §6): a pure core, the gRPC service, the CLI."""
