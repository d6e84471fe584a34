"""flagella datapath service: the privileged eBPF datapath of one node."""
