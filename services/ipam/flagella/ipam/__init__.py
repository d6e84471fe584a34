"""flagella ipam service: node registry, per-node pod CIDRs and IP allocations."""
