"""flagella-cni: the CNI plugin, a client of the endpoint service."""
