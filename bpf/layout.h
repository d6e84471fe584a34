/* flagella datapath: map layouts and constants shared by the programs.
 *
 * Mirrored byte for byte by flagella.datapath.bpf.layout (ctypes); the
 * loader checks every size at load time. Any change here is a layout
 * change: bump LAYOUT_VERSION in layout.py (the pin folder name also
 * carries a hash of the ctypes layouts, so a forgotten bump still gets a
 * fresh folder). See docs/datapath-bpf.md.
 *
 * Addresses are 16 bytes everywhere: IPv6 as is, IPv4 as v4-mapped
 * (::ffff:a.b.c.d), so one map serves both families.
 */
#ifndef FLAGELLA_LAYOUT_H
#define FLAGELLA_LAYOUT_H

/* Map sizes are given at load time by the Python loader; the compile only
 * needs a placeholder. */
#define COMPILE_MAX 1

union v6addr {
	__u8 u8[16];
	__u32 u32[4];
};

/* --- reserved identities (as Cilium) --- */
#define ID_UNKNOWN 0
#define ID_HOST 1
#define ID_WORLD 2
#define ID_UNMANAGED 3
#define ID_HEALTH 4
#define ID_INIT 5
#define ID_REMOTE_NODE 6
/* Identities at or above this are node-local CIDR identities (world-ish). */
#define ID_LOCAL_SCOPE (1U << 24)

/* --- drop reasons: the numbers of flagella.datapath.v1.DropReason --- */
#define REASON_FORWARDED 0
/* Drop reasons: Cilium's numbers (flow.proto DropReason) where the meaning
 * is the same, flagella's own from 230 (Cilium uses 130-203). */
#define DROP_POLICY_L3 133            /* Cilium POLICY_DENIED */
#define DROP_POLICY_L4 230            /* flagella only */
#define DROP_POLICY_DENY 181          /* Cilium POLICY_DENY */
#define DROP_POLICY_NOT_READY 165     /* Cilium NO_CONFIGURATION_AVAILABLE_TO_PERFORM_POLICY_DECISION */
#define DROP_NO_BACKEND 158           /* Cilium SERVICE_BACKEND_NOT_FOUND */
#define DROP_SOURCE_RANGE 177         /* Cilium DENIED_BY_LB_SRC_RANGE_CHECK */
#define DROP_CT_INSERT_FAILED 155     /* Cilium CT_MAP_INSERTION_FAILED */
#define DROP_CT_INVALID 135           /* Cilium CT_TRUNCATED_OR_INVALID_HEADER */
#define DROP_NAT_FAILED 167           /* Cilium NO_MAPPING_FOR_NAT_MASQUERADE */
#define DROP_INVALID_PACKET 134       /* Cilium INVALID_PACKET_DROPPED */
#define DROP_INVALID_SOURCE_IP 132    /* Cilium INVALID_SOURCE_IP */
#define DROP_UNSUPPORTED_L3 139       /* Cilium UNSUPPORTED_L3_PROTOCOL */
#define DROP_UNKNOWN_ENDPOINT 152     /* Cilium NO_MATCHING_LOCAL_CONTAINER_FOUND */
#define DROP_FIB_LOOKUP_FAILED 169    /* Cilium FIB_LOOKUP_FAILED */
#define DROP_REDIRECT_FAILED 231      /* flagella only */
#define DROP_FRAG_NOT_SUPPORTED 175   /* Cilium FIRST_LOGICAL_DATAGRAM_FRAGMENT_NOT_FOUND */
#define DROP_UNKNOWN_NODE 232         /* flagella only */
#define DROP_NO_TUNNEL_ENDPOINT 160   /* Cilium NO_TUNNEL_OR_ENCAPSULATION_ENDPOINT */
#define DROP_TTL_EXCEEDED 196         /* Cilium TTL_EXCEEDED */
/* metrics only: the host policy's safety set let the node's own packet
 * through before policy (host firewall, see HOST_EP_ID) */
#define REASON_HOST_SAFETY 1
/* metrics only: events the ring buffer had no room for (direction 0) */
#define METRIC_EVENTS_LOST 255

/* FlowDirection */
#define DIR_UNSPEC 0
#define DIR_INGRESS 1 /* into the pod (to-container, from-netdev) */
#define DIR_EGRESS 2  /* out of the pod (from-container, to-netdev) */

/* FlowType / FlowVerdict */
#define EV_DROP 1
#define EV_POLICY_VERDICT 2
#define EV_TRACE 3
#define EV_HOST_SAFETY 4 /* a host connection let through by the safety set */
#define VERDICT_FORWARDED 1
#define VERDICT_DROPPED 2
#define VERDICT_AUDIT 4 /* Hubble's AUDIT: policy would drop, audit mode let it through */

/* --- endpoints (cilium_lxc): local endpoint by IP --- */
#define EP_F_POLICY_READY (1U << 0)
#define EP_F_INGRESS_ENFORCED (1U << 1)
#define EP_F_EGRESS_ENFORCED (1U << 2)
/* The endpoint has prefix_policy entries (Kubernetes ipBlocks): consulted
 * when the identity lookups neither allow nor deny. */
#define EP_F_PREFIX_POLICY (1U << 3)
/* Policy audit mode: what the policy would drop passes, reported as an
 * AUDIT verdict (runtime configuration, cluster-wide or per endpoint). */
#define EP_F_AUDIT (1U << 4)
/* Egress toFQDNs select the endpoint: its DNS (UDP and TCP port 53, to any
 * server) goes to the node's DNS proxy (dnsproxy; docs/datapath-bpf.md). A
 * high bit, so flags others add below it never collide. */
#define EP_F_DNS_PROXY (1U << 12)

struct endpoint_key {
	union v6addr addr;
};

struct endpoint_info {
	__u64 ep_id;
	__u64 policy_revision; /* control-plane revision realized (info) */
	__u32 ifindex;         /* host-side veth */
	__u32 identity;
	__u32 flags;           /* EP_F_* */
	__u32 policy_gen;      /* bumped on every policy write: CT revalidation */
	__u8 mac[6];           /* the pod's interface */
	__u8 node_mac[6];      /* the host-side veth */
	__u32 pad;
};

/* --- ipcache (cilium_ipcache): LPM over (family, address) --- */
struct ipcache_key {
	__u32 prefixlen; /* 8 (family) + bits of addr; IPv4: 8 + 96 + plen */
	__u8 family;     /* 4 or 6 */
	__u8 addr[16];
	__u8 pad[3];
};

/* The prefix is inside the cluster (a node's pod CIDR, a node): pod
 * traffic to it is never masqueraded, whatever its identity. */
#define IPC_F_CLUSTER (1U << 0)

struct ipcache_value {
	__u32 identity;
	__u32 flags;        /* IPC_F_* */
	__be32 tunnel_ip;   /* tunnel mode: the node hosting the prefix (IPv4
			     * underlay); 0: this node, or not in a pod CIDR */
	__u32 pad;
};

/* --- policy: one LPM trie for every endpoint ---
 * Data bits, in order: identity (32), ep_id (64), direction (8) are always
 * full; then protocol (8) and dport (16, network order) may be cut:
 *   104: every protocol and port of (identity, ep, dir)
 *   112: every port of the protocol
 *   112 + n: the ports sharing the first n bits of dport (ranges are
 *            expanded into such prefixes by the loader)
 * identity 0 means any peer; it is a second lookup, not a prefix. */
#define POLICY_PREFIX_L3 104
#define POLICY_PREFIX_PROTO 112
#define POLICY_PREFIX_FULL 128
/* An ICMP packet's key port: its type above the 8 bits of "every port"
 * (port 0), so that type 0 (echo reply) is a key of its own. */
#define ICMP_TYPE_PORT 0x100

#define POLICY_ALLOW 1
#define POLICY_DENY 2
/* (identity, ep, dir) has port-specific entries but no L3-wide one: a
 * miss on the ports drops with POLICY_L4 instead of POLICY_L3. */
#define POLICY_L4_ONLY 3

struct policy_key {
	__u32 prefixlen;
	__u32 identity;
	__u64 ep_id;
	__u8 dir;     /* DIR_INGRESS / DIR_EGRESS */
	__u8 proto;
	__be16 dport; /* ICMP: ICMP_TYPE_PORT | the type */
	__u32 pad;
};

struct policy_value {
	__u8 verdict; /* POLICY_* */
	__u8 pad[3];
	__u32 cookie; /* free for the control plane (rule reference) */
};

/* --- prefix_policy: Kubernetes ipBlocks over peer addresses ---
 * LPM over (direction, family, endpoint: always full, 96 bits) then the
 * peer address (v4-mapped for IPv4: 96 + 96 + plen). The control plane
 * flattens nested blocks and excepts: the longest matching prefix lists
 * everything allowed for the address (an except: what other blocks allow
 * there, possibly nothing). Allow only; a miss changes nothing. */
#define PREFIX_POLICY_KEY_BITS 96
#define PREFIX_POLICY_PORTS 16

struct prefix_policy_key {
	__u32 prefixlen;
	__u8 dir;    /* DIR_INGRESS / DIR_EGRESS */
	__u8 family; /* 4 or 6 */
	__u16 pad;
	__u64 ep_id;
	__u8 addr[16];
};

/* Inclusive host-order port range of one protocol (0: any protocol, then
 * lo 0 and hi 65535); ICMP: the type. */
struct prefix_port {
	__u16 lo;
	__u16 hi;
	__u8 proto;
	__u8 pad[3];
};

struct prefix_policy_value {
	__u32 count; /* ports[0..count) are used */
	struct prefix_port ports[PREFIX_POLICY_PORTS];
};

/* --- services (cilium_lb4_services_v2): slot 0 is the service, slots
 * 1..count list its active backends (random selection) --- */
#define SVC_F_NODEPORT (1U << 0)
#define SVC_F_MAGLEV (1U << 1)
#define SVC_F_AFFINITY (1U << 2)
#define SVC_F_SOURCE_RANGE (1U << 3)
/* externalTrafficPolicy Local: traffic from outside the node is balanced
 * over the entry of scope SVC_SCOPE_LOCAL (this node's own active
 * backends; none: dropped), pods' traffic over this one (all backends), as
 * Cilium's two-scope services. */
#define SVC_F_EXT_LOCAL (1U << 4)

/* svc_key.scope: the frontend's entry for everyone (0), its entry for
 * traffic from outside the node under externalTrafficPolicy Local (1). */
#define SVC_SCOPE_ALL 0
#define SVC_SCOPE_LOCAL 1

/* lb.v1.BackendState: only active backends get new connections (also
 * through session affinity). */
#define BACKEND_ACTIVE 1

struct svc_key {
	union v6addr addr;
	__be16 dport;
	__u16 slot;
	__u8 proto;
	__u8 scope;
	__u16 pad;
};

struct svc_value {
	__u32 backend_id;        /* slots > 0 */
	__u32 count;             /* slot 0: active backends */
	__u32 rev_nat_id;        /* this frontend's reverse NAT */
	__u32 service_id;        /* the service: Maglev, affinity, source ranges */
	__u32 flags;             /* SVC_F_* */
	__u32 affinity_timeout;  /* seconds */
	__u32 maglev_size;       /* M of the Maglev table (informational: the
				  * table holds its own size) */
	__u32 pad;
};

/* --- backends (cilium_lb4_backends_v3) --- */
struct backend_value {
	union v6addr addr;
	__be16 port;
	__u8 proto;
	__u8 state; /* lb.v1.BackendState: affinity only reuses BACKEND_ACTIVE */
	__u32 pad;
};

/* --- rev-NAT (cilium_lb4_reverse_nat) --- */
struct revnat_value {
	union v6addr addr;
	__be16 port;
	__u16 pad;
};

/* --- Maglev (cilium_lb4_maglev): a hash of maps, service_id -> that
 * service's table, an array of 1 + M backend ids: index 0 holds M, index
 * 1 + slot the backend of a slot. Inner arrays may have any size
 * (BPF_F_INNER_MAP), so each service gets exactly its M, allocated when
 * its table is written; a table is replaced whole by one update of the
 * outer map (a packet sees the old or the new table, never a mix). --- */
#define MAGLEV_SIZE_INDEX 0

/* --- session affinity (cilium_lb4_affinity) --- */
struct affinity_key {
	union v6addr client;
	__u32 service_id;
};

struct affinity_value {
	__u64 last_used; /* bpf_ktime_get_ns() */
	__u32 backend_id;
	__u32 pad;
};

/* --- loadBalancerSourceRanges (cilium_lb4_source_range) --- */
struct srcrange_key {
	__u32 prefixlen; /* 32 (service_id) + 8 (family) + address bits */
	__u32 service_id;
	__u8 family;
	__u8 addr[16];
	__u8 pad[3];
};

/* --- conntrack (cilium_ct_any4_global) --- */
#define CT_SCOPE_EGRESS 0  /* opened by a local pod (from-container) */
#define CT_SCOPE_INGRESS 1 /* opened towards a local pod (to-container) */
#define CT_SCOPE_SERVICE 2 /* client -> frontend: the chosen backend */
/* NodePort from outside to a local backend: outside client -> backend
 * (after DNAT), created in from-netdev; holds the rev-NAT id the reply gets
 * on its way out of the uplink (to-netdev). */
#define CT_SCOPE_NODEPORT 3

#define CT_F_SEEN_NON_SYN (1U << 0)
#define CT_F_TX_CLOSING (1U << 1)
#define CT_F_RX_CLOSING (1U << 2)
#define CT_F_REPLY_SEEN (1U << 3)

struct ct_key {
	union v6addr saddr; /* the connection's original direction */
	union v6addr daddr;
	__be16 sport;       /* ICMP echo: sport = id (request), dport = id (reply) */
	__be16 dport;
	__u8 proto;
	__u8 scope;         /* CT_SCOPE_*; NAT map: NAT_OUT / NAT_IN */
	__u16 pad;
};

struct ct_entry {
	__u64 expires;     /* bpf_ktime_get_ns() deadline (CLOCK_MONOTONIC) */
	__u32 backend_id;  /* SERVICE scope */
	__u32 rev_nat_id;  /* EGRESS scope after DNAT: reverse NAT of replies */
	__u32 policy_gen;  /* endpoint policy_gen the verdict was taken at */
	__u32 identity;    /* peer identity at creation */
	__u16 flags;       /* CT_F_* */
	__u16 pad;
	__u32 pad2;
};

/* The host firewall's connections (only tracked while a host policy is
 * loaded): opened by the node itself, and towards it. */
#define CT_SCOPE_HOST_OUT 4
#define CT_SCOPE_HOST_IN 5

/* --- masquerade and NodePort SNAT (cilium_snat_v4_external): both
 * directions in one map --- */
#define NAT_OUT 0 /* key: tuple as sent (pod, or outside client after DNAT);
		   * value: node address and port */
#define NAT_IN 1  /* key: reply tuple as received; value: the address and port
		   * to restore as destination (pod, or outside client) */

/* A NodePort connection to a remote backend, SNATed to the node address:
 * a NAT_IN reply also gets its source set back to the frontend
 * (rev_nat_id) and is sent out towards the client. */
#define NAT_F_NODEPORT (1U << 0)

struct nat_value {
	union v6addr addr;
	__be16 port;
	__u16 flags;      /* NAT_F_* */
	__u32 rev_nat_id; /* NAT_IN with NAT_F_NODEPORT: the frontend */
	__u64 expires;
};

/* --- IP fragments (cilium_ipv4_frag_datagrams): the first fragment's
 * ports (and ICMP type), so the datagram's later fragments, which carry no
 * L4 header, get the same conntrack entry, verdict and translation --- */
struct frag_key {
	union v6addr saddr;
	union v6addr daddr;
	__be32 id;  /* IPv4: the header's 16-bit id; IPv6: the fragment header's */
	__u8 proto;
	__u8 pad[3];
};

struct frag_value {
	__be16 sport;
	__be16 dport;
	__u8 icmp_type;
	__u8 echo;
	__u16 pad;
};

/* --- node configuration: one entry --- */
#define CFG_MASQUERADE4 (1U << 0)
#define CFG_MASQUERADE6 (1U << 1)
#define CFG_ALLOW_HOST (1U << 2)   /* host identity always reaches local pods */
#define CFG_VERDICT_EVENTS (1U << 3) /* emit policy-verdict events */
#define CFG_DROP_EVENTS (1U << 4)  /* emit drop events */
#define CFG_TUNNEL (1U << 5)       /* tunnel routing mode: pods of other nodes via VXLAN */
/* Host firewall: a host policy is loaded (without it the node's own
 * traffic costs one flag test), and which of its directions it enforces. */
#define CFG_HOST_POLICY (1U << 6)
#define CFG_HOST_INGRESS (1U << 7)
#define CFG_HOST_EGRESS (1U << 8)
/* With CFG_VERDICT_EVENTS: an allowed new connection is reported only in a
 * direction whose policy is enforced (Cilium's policy-verdict filter). */
#define CFG_VERDICT_ENFORCED (1U << 9)

struct dp_config {
	union v6addr node_ip4; /* v4-mapped; zero: none */
	union v6addr node_ip6;
	__u32 flags;           /* CFG_* */
	__u16 nat_port_min;    /* host order, inclusive */
	__u16 nat_port_max;
	__u32 tunnel_ifindex;  /* CFG_TUNNEL: the collect-metadata VXLAN device */
	__be16 tunnel_port;    /* CFG_TUNNEL: its UDP port */
	__u16 dns_proxy_port;  /* host order; 0: no DNS proxy (nothing redirected) */
};

/* --- host firewall ---
 * The node's host is an endpoint of identity host (1) whose policy-map
 * entries use this endpoint id (no pod has it: endpoint ids are below
 * 16^12). Flows judged by the host policy carry it too. */
#define HOST_EP_ID 0xFFFFFFFFFFFFFFFFULL

/* The safety set (host_safe): the node's traffic with its control plane,
 * let through before any host policy. */
#define SAFE_REMOTE 0      /* a control-plane server: (its address, its port) */
#define SAFE_LOCAL_PORT 1  /* a server of this node the control plane calls: its port */
#define SAFE_ANY_PORT 2    /* a port on any node (health probes): the remote port */

struct host_safe_key {
	union v6addr addr; /* SAFE_REMOTE only; zero otherwise */
	__be16 port;
	__u8 proto;
	__u8 scope;        /* SAFE_* */
};

/* --- tunnel mode: the source identity rides in the VNI; from-tunnel hands
 * it to the destination's to-container in skb->mark (a packet from a pod
 * has its mark scrubbed crossing into the node's netns). --- */
#define MARK_MAGIC_MASK 0xFF000000U
#define MARK_MAGIC_IDENTITY 0x0F000000U
#define MARK_IDENTITY_MASK 0x00FFFFFFU
/* A pod's DNS assigned to the proxy's socket: the node routes it locally
 * (an ip rule on this mark; dnsproxy/redirect.py). */
#define MARK_MAGIC_TO_PROXY 0x0A000000U
#define TUNNEL_TTL 64

/* --- metrics (cilium_metrics): index = direction * 256 + reason --- */
struct metrics_value {
	__u64 packets;
	__u64 bytes;
};

/* --- flow events (ring buffer) --- */
struct flow_event {
	__u64 ts;           /* bpf_ktime_get_ns() */
	__u64 ep_id;
	__u32 src_identity;
	__u32 dst_identity;
	__u32 ifindex;
	__u8 type;          /* EV_* */
	__u8 verdict;       /* VERDICT_* */
	__u8 reason;        /* DROP_* or 0 */
	__u8 direction;     /* DIR_* */
	__u8 proto;
	__u8 family;
	__be16 sport;
	__be16 dport;
	__u8 tcp_flags;     /* TCP: header byte 13 (FIN 0x01 .. CWR 0x80); else 0 */
	__u8 icmp_type;     /* ICMP / ICMPv6: the type; else 0 */
	union v6addr saddr;
	union v6addr daddr;
};

#endif
