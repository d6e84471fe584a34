"""flagella policy service: security identities, the ipcache, network policy
rules and their resolution."""
