"""Test harness: real etcd servers, service processes and helpers shared by
the integration, privileged and e2e tests (importable as `harness`)."""
