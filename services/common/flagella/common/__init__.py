"""Code shared by every flagella service: configuration, logging, tracing,
the gRPC server bootstrap, domain errors, the etcd client and the reconciler.
Importing this package is cheap; import the submodules you need."""
