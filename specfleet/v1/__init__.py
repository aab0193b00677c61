"""Generated gRPC stubs for proto/specfleet/v1 (regenerate with `make proto`)."""
