"""flagella endpoint service: endpoint lifecycle; orchestrates ipam, policy and
the node's datapath for CNI."""
