"""The node's DNS proxy (toFQDNs): sockets, the server, what answers teach."""
