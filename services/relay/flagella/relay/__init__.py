"""flagella relay: every node's flows through one API (as Hubble Relay)."""
