"""This node's BGP control plane (as Cilium's, which embeds GoBGP): a gobgpd
child process driven over its gRPC API, configured by the lb's peering
policies that select the node.

- model: the policies and services as this node follows them, and the pure
  logic of what the node's speaker should be (desired peers, paths and
  export policies);
- gobgp: the adapter to gobgpd's API (flagella.api.gobgp.v3, a subset of
  GoBGP's own proto);
- supervisor: the gobgpd process (started, adopted after a datapath
  restart, restarted with backoff when it dies, stopped);
- speaker: ties them: follows the tables, reconciles gobgpd to the desired
  state after any change or restart, answers the BGP API.

No BGP protocol code is written here: gobgpd speaks BGP.
"""
