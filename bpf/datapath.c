/* flagella datapath: tc programs, compiled once by bcc and shared by every
 * endpoint (per-endpoint data lives in maps only).
 *
 *   from_container  tc ingress of a pod's host-side veth (traffic leaving the pod)
 *   to_container    tc egress of a pod's host-side veth (traffic entering the pod)
 *   to_proxy        tc ingress of a pod's host-side veth, after from_container:
 *                   DNS to the node's DNS proxy (bpf_sk_assign)
 *   to_netdev       tc egress of the node's uplink: masquerade (SNAT), reverse
 *                   NAT of NodePort replies from local backends
 *   from_netdev     tc ingress of the node's uplink: NodePort (DNAT to a local
 *                   backend, or DNAT + SNAT to a remote one), reverse SNAT
 *   from_tunnel     tc ingress of the VXLAN device (tunnel mode): the source
 *                   identity from the VNI, delivery to the local pod
 *   to_tunnel       tc egress of the VXLAN device: the tunnel key of what the
 *                   node's own stack routes into it
 *   xdp_prefilter   XDP of the node's devices: drops sources in listed CIDRs
 *
 * Layouts and constants: layout.h. Behaviour: docs/datapath-bpf.md.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/if_packet.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/icmp.h>
#include <uapi/linux/icmpv6.h>

#define AF_INET 2
#define AF_INET6 10

/* bcc 0.26 declares bpf_redirect_neigh without its plen argument. */
static long (*redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
			      __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

#include "layout.h"

/* Maps. Sizes are placeholders: the loader creates (or reuses) the pinned
 * maps with their real sizes and points the programs at them. */
BPF_TABLE("hash", struct endpoint_key, struct endpoint_info, endpoints, COMPILE_MAX);
BPF_F_TABLE("lpm_trie", struct ipcache_key, struct ipcache_value, ipcache, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("lpm_trie", struct policy_key, struct policy_value, policy, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("lpm_trie", struct prefix_policy_key, struct prefix_policy_value, prefix_policy, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_TABLE("hash", struct svc_key, struct svc_value, services, COMPILE_MAX);
BPF_TABLE("hash", __u32, struct backend_value, backends, COMPILE_MAX);
BPF_TABLE("hash", __u32, struct revnat_value, revnat, COMPILE_MAX);
/* Maglev: service_id -> the service's table (an array, see layout.h). The
 * inner template is only there for bcc; the loader gives the real map its
 * own template. */
BPF_F_TABLE("array", __u32, __u32, maglev_inner, COMPILE_MAX, BPF_F_INNER_MAP);
BPF_F_TABLE("hash_of_maps$maglev_inner", __u32, int, maglev, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_TABLE("lru_hash", struct affinity_key, struct affinity_value, affinity, COMPILE_MAX);
BPF_F_TABLE("lpm_trie", struct srcrange_key, __u32, srcrange, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_TABLE("lru_hash", struct ct_key, struct ct_entry, ct, COMPILE_MAX);
BPF_TABLE("lru_hash", struct ct_key, struct nat_value, snat, COMPILE_MAX);
BPF_TABLE("lru_hash", struct frag_key, struct frag_value, frags, COMPILE_MAX);
BPF_TABLE("array", __u32, struct dp_config, config, 1);
BPF_TABLE("hash", struct host_safe_key, __u32, host_safe, COMPILE_MAX);
BPF_TABLE("percpu_array", __u32, struct metrics_value, metrics, 768);
BPF_RINGBUF_OUTPUT(events, 1);
/* Never used by a program: lets the loader check struct flow_event. */
BPF_TABLE("array", __u32, struct flow_event, event_layout, 1);

#define NSEC 1000000000ULL
#define CT_LIFETIME_TCP (21600ULL * NSEC)
#define CT_LIFETIME_SYN (60ULL * NSEC)
#define CT_LIFETIME_CLOSE (10ULL * NSEC)
#define CT_LIFETIME_NONTCP (60ULL * NSEC)
/* Lifetimes are extended at most once per this interval (fewer writes). */
#define CT_UPDATE_GRANULARITY (1ULL * NSEC)
#define NAT_PORT_TRIES 16

#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF
#define IP6_OFFSET 0xFFF8 /* the fragment header's frag_off, host order */

/* The IPv6 fragment header (bcc's 6.1 uapi headers have none). */
struct frag_hdr {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off;
	__be32 identification;
};

#define PASS 1 /* parse result: let it through untouched (ARP, ND) */

struct pkt {
	union v6addr saddr;
	union v6addr daddr;
	__be16 sport;
	__be16 dport;
	__u32 len;
	__u16 l4_off;
	__u16 csum_off;  /* 0: no L4 checksum to fix */
	__u8 proto;
	__u8 family;     /* 4 / 6 */
	__u8 tcp_flags;
	__u8 icmp_type;
	__u8 echo;       /* ICMP echo: the id sits at l4_off + 4 */
	__u8 csum_flags; /* extra bpf_l4_csum_replace flags (UDP: mangled 0) */
	__u8 icmp_error; /* ICMP error: an inner packet follows at l4_off + 8 */
	__u8 frag_later; /* a later IP fragment: no L4 header, ports from frags */
};

static __always_inline void set_v4mapped(union v6addr *a, __be32 ip)
{
	a->u32[0] = 0;
	a->u32[1] = 0;
	a->u32[2] = bpf_htonl(0xffff);
	a->u32[3] = ip;
}

static __always_inline int addr_is_v4(const union v6addr *a)
{
	return a->u32[0] == 0 && a->u32[1] == 0 && a->u32[2] == bpf_htonl(0xffff);
}

static __always_inline int addr_eq(const union v6addr *a, const union v6addr *b)
{
	return a->u32[0] == b->u32[0] && a->u32[1] == b->u32[1] &&
	       a->u32[2] == b->u32[2] && a->u32[3] == b->u32[3];
}

static __always_inline int addr_is_zero(const union v6addr *a)
{
	return (a->u32[0] | a->u32[1] | a->u32[2] | a->u32[3]) == 0;
}

static __always_inline void addr_copy(union v6addr *dst, const union v6addr *src)
{
	dst->u32[0] = src->u32[0];
	dst->u32[1] = src->u32[1];
	dst->u32[2] = src->u32[2];
	dst->u32[3] = src->u32[3];
}

/* Ports and ICMP of the L4 header at p->l4_off (direct packet access). */
/* A pod reaching itself through a service (hairpin): after the DNAT to its
 * own address, its source becomes this link-local address (Cilium's
 * IPV4_LOOPBACK), so that its kernel takes the packet (a packet from one of
 * its own addresses arriving on eth0 is a martian) and its reply leaves
 * through eth0 again, to be translated back. IPv4 only. */
#define HAIRPIN_V4 0xa9fe2a01 /* 169.254.42.1 */

static __always_inline int is_hairpin_addr(const union v6addr *a)
{
	return addr_is_v4(a) && a->u32[3] == bpf_htonl(HAIRPIN_V4);
}

static __always_inline int parse_l4(struct __sk_buff *skb, struct pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 off = p->l4_off;

	if (off > 256)
		return -DROP_INVALID_PACKET;
	void *l4 = data + off;

	switch (p->proto) {
	case IPPROTO_TCP: {
		struct tcphdr *th = l4;
		if ((void *)(th + 1) > end)
			return -DROP_INVALID_PACKET;
		p->sport = th->source;
		p->dport = th->dest;
		p->tcp_flags = ((__u8 *)th)[13];
		p->csum_off = off + offsetof(struct tcphdr, check);
		break;
	}
	case IPPROTO_UDP: {
		struct udphdr *uh = l4;
		if ((void *)(uh + 1) > end)
			return -DROP_INVALID_PACKET;
		p->sport = uh->source;
		p->dport = uh->dest;
		p->csum_off = off + offsetof(struct udphdr, check);
		p->csum_flags = BPF_F_MARK_MANGLED_0;
		break;
	}
	case IPPROTO_SCTP: {
		__be16 *ports = l4;
		if ((void *)(ports + 2) > end)
			return -DROP_INVALID_PACKET;
		p->sport = ports[0];
		p->dport = ports[1];
		break;
	}
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6: {
		__u8 *ic = l4;
		if ((void *)(ic + 8) > end)
			return -DROP_INVALID_PACKET;
		__u8 type = ic[0];
		__be16 id = *(__be16 *)(ic + 4);
		p->icmp_type = type;
		p->csum_off = off + 2;
		if (p->proto == IPPROTO_ICMP) {
			if (type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED ||
			    type == ICMP_PARAMETERPROB)
				p->icmp_error = 1;
			if (type == ICMP_ECHO) {
				p->sport = id;
				p->echo = 1;
			} else if (type == ICMP_ECHOREPLY) {
				p->dport = id;
				p->echo = 1;
			}
		} else {
			if (type >= ICMPV6_DEST_UNREACH && type <= ICMPV6_PARAMPROB)
				p->icmp_error = 1;
			if (type == ICMPV6_ECHO_REQUEST) {
				p->sport = id;
				p->echo = 1;
			} else if (type == ICMPV6_ECHO_REPLY) {
				p->dport = id;
				p->echo = 1;
			} else if (type == ICMPV6_MGM_QUERY || type == ICMPV6_MGM_REPORT ||
				   type == ICMPV6_MGM_REDUCTION || type == 143 ||
				   (type >= 133 && type <= 137)) {
				/* neighbour discovery and MLD: not ours to police */
				return PASS;
			}
		}
		break;
	}
	default:
		break;
	}
	return 0;
}

static __always_inline void frag_fill(struct frag_key *k, struct pkt *p, __be32 id)
{
	addr_copy(&k->saddr, &p->saddr);
	addr_copy(&k->daddr, &p->daddr);
	k->id = id;
	k->proto = p->proto;
}

/* The first fragment of a datagram: remember its ports for the others. */
static __always_inline void frag_first(struct pkt *p, __be32 id)
{
	struct frag_key k = {};
	struct frag_value v = {};
	frag_fill(&k, p, id);
	v.sport = p->sport;
	v.dport = p->dport;
	v.icmp_type = p->icmp_type;
	v.echo = p->echo;
	frags.update(&k, &v);
}

/* A later fragment: the ports its first fragment had; there is no L4
 * header to read or rewrite (checksums included). */
static __always_inline int frag_later(struct pkt *p, __be32 id)
{
	struct frag_key k = {};
	frag_fill(&k, p, id);
	struct frag_value *v = frags.lookup(&k);
	if (!v)
		return -DROP_FRAG_NOT_SUPPORTED;
	p->sport = v->sport;
	p->dport = v->dport;
	p->icmp_type = v->icmp_type;
	p->echo = v->echo;
	p->frag_later = 1;
	p->csum_off = 0;
	return 0;
}

/* Fills p from the packet. Returns 0, PASS, or -reason. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > end)
		return -DROP_INVALID_PACKET;
	p->len = skb->len;

	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return -DROP_INVALID_PACKET;
		if (ip->ihl < 5 || ip->version != 4)
			return -DROP_INVALID_PACKET;
		__u16 fo = bpf_ntohs(ip->frag_off);
		__be32 id = ip->id;
		p->family = 4;
		p->proto = ip->protocol;
		set_v4mapped(&p->saddr, ip->saddr);
		set_v4mapped(&p->daddr, ip->daddr);
		p->l4_off = ETH_HLEN + ip->ihl * 4;
		if (fo & IP_OFFSET)
			return frag_later(p, id);
		int ret = parse_l4(skb, p);
		if (ret == 0 && (fo & IP_MF))
			frag_first(p, id);
		return ret;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return -DROP_INVALID_PACKET;
		p->family = 6;
		__builtin_memcpy(p->saddr.u8, ip6->saddr.in6_u.u6_addr8, 16);
		__builtin_memcpy(p->daddr.u8, ip6->daddr.in6_u.u6_addr8, 16);
		__u8 nh = ip6->nexthdr;
		__u32 off = ETH_HLEN + sizeof(struct ipv6hdr);
		__be32 frag_id = 0;
		int first = 0;
#pragma unroll
		for (int i = 0; i < 4; i++) {
			__u8 ext[2];
			if (nh == IPPROTO_FRAGMENT) {
				struct frag_hdr fh;
				if (bpf_skb_load_bytes(skb, off, &fh, sizeof(fh)) < 0)
					return -DROP_INVALID_PACKET;
				nh = fh.nexthdr;
				off += sizeof(fh);
				frag_id = fh.identification;
				if (bpf_ntohs(fh.frag_off) & IP6_OFFSET) {
					p->proto = nh;
					p->l4_off = off;
					return frag_later(p, frag_id);
				}
				first = 1;
				continue;
			}
			if (nh != IPPROTO_HOPOPTS && nh != IPPROTO_ROUTING &&
			    nh != IPPROTO_DSTOPTS && nh != IPPROTO_AH)
				break;
			if (bpf_skb_load_bytes(skb, off, ext, 2) < 0)
				return -DROP_INVALID_PACKET;
			if (nh == IPPROTO_AH)
				off += (ext[1] + 2) * 4;
			else
				off += (ext[1] + 1) * 8;
			nh = ext[0];
		}
		p->proto = nh;
		p->l4_off = off;
		int ret6 = parse_l4(skb, p);
		if (ret6 == 0 && first)
			frag_first(p, frag_id);
		return ret6;
	}
	if (eth->h_proto == bpf_htons(ETH_P_ARP))
		return PASS;
	return -DROP_UNSUPPORTED_L3;
}

static __always_inline struct dp_config *get_config(void)
{
	__u32 zero = 0;
	return config.lookup(&zero);
}

static __always_inline void count(__u8 dir, __u8 reason, __u32 len)
{
	__u32 idx = ((__u32)dir << 8) | reason;
	struct metrics_value *m = metrics.lookup(&idx);
	if (m) {
		m->packets += 1;
		m->bytes += len;
	}
}

static __always_inline void emit(struct __sk_buff *skb, struct pkt *p, __u8 type, __u8 verdict,
				 __u8 reason, __u8 dir, __u64 ep_id, __u32 src_id, __u32 dst_id)
{
	struct flow_event *ev = events.ringbuf_reserve(sizeof(struct flow_event));
	if (!ev) {
		count(DIR_UNSPEC, METRIC_EVENTS_LOST, 0);
		return;
	}
	ev->ts = bpf_ktime_get_ns();
	ev->ep_id = ep_id;
	ev->src_identity = src_id;
	ev->dst_identity = dst_id;
	ev->ifindex = skb->ifindex;
	ev->type = type;
	ev->verdict = verdict;
	ev->reason = reason;
	ev->direction = dir;
	ev->proto = p->proto;
	ev->family = p->family;
	ev->sport = p->sport;
	ev->dport = p->dport;
	ev->tcp_flags = p->tcp_flags;
	ev->icmp_type = p->icmp_type;
	addr_copy(&ev->saddr, &p->saddr);
	addr_copy(&ev->daddr, &p->daddr);
	events.ringbuf_submit(ev, 0);
}

/* Does an allowed new connection get a policy-verdict event? enforced: the
 * endpoint's policy is enforced in the connection's direction. */
static __always_inline int verdict_event(struct dp_config *cfg, int enforced)
{
	if (!cfg || !(cfg->flags & CFG_VERDICT_EVENTS))
		return 0;
	return enforced || !(cfg->flags & CFG_VERDICT_ENFORCED);
}

static __always_inline int drop(struct __sk_buff *skb, struct pkt *p, __u8 reason, __u8 dir,
				__u64 ep_id, __u32 src_id, __u32 dst_id)
{
	struct dp_config *cfg = get_config();
	count(dir, reason, p->len);
	if (cfg && (cfg->flags & CFG_DROP_EVENTS))
		emit(skb, p, EV_DROP, VERDICT_DROPPED, reason, dir, ep_id, src_id, dst_id);
	return TC_ACT_SHOT;
}

/* Policy audit mode (EP_F_AUDIT): a packet the endpoint's policy drops
 * (reason) passes, reported as an AUDIT verdict whatever the event
 * settings. 1: audited, pass it on; 0: drop it. */
static __always_inline int audited(struct __sk_buff *skb, struct pkt *p, struct endpoint_info *ep,
				   int reason, __u8 dir, __u32 src_id, __u32 dst_id)
{
	if (!(ep->flags & EP_F_AUDIT))
		return 0;
	emit(skb, p, EV_POLICY_VERDICT, VERDICT_AUDIT, reason, dir, ep->ep_id, src_id, dst_id);
	return 1;
}

/* --- address and port rewriting with checksum updates --- */

static __always_inline int rewrite_addr(struct __sk_buff *skb, struct pkt *p, int is_src,
					const union v6addr *nw)
{
	union v6addr *cur = is_src ? &p->saddr : &p->daddr;

	if (p->family == 4) {
		__be32 old = cur->u32[3];
		__be32 new4 = nw->u32[3];
		__u32 off = ETH_HLEN + (is_src ? offsetof(struct iphdr, saddr) : offsetof(struct iphdr, daddr));
		if (p->csum_off && p->proto != IPPROTO_ICMP) {
			if (bpf_l4_csum_replace(skb, p->csum_off, old, new4,
						BPF_F_PSEUDO_HDR | p->csum_flags | 4) < 0)
				return -1;
		}
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old, new4, 4) < 0)
			return -1;
		if (bpf_skb_store_bytes(skb, off, &new4, 4, 0) < 0)
			return -1;
	} else {
		__u32 off = ETH_HLEN + (is_src ? offsetof(struct ipv6hdr, saddr) : offsetof(struct ipv6hdr, daddr));
		union v6addr old;
		union v6addr new6;
		addr_copy(&old, cur);
		addr_copy(&new6, nw);
		if (p->csum_off) {
			__s64 diff = bpf_csum_diff(old.u32, 16, new6.u32, 16, 0);
			if (diff < 0)
				return -1;
			if (bpf_l4_csum_replace(skb, p->csum_off, 0, diff,
						BPF_F_PSEUDO_HDR | p->csum_flags) < 0)
				return -1;
		}
		if (bpf_skb_store_bytes(skb, off, new6.u8, 16, 0) < 0)
			return -1;
	}
	addr_copy(cur, nw);
	return 0;
}

static __always_inline int rewrite_port(struct __sk_buff *skb, struct pkt *p, int is_src, __be16 nw)
{
	__be16 *cur = is_src ? &p->sport : &p->dport;
	__be16 old = *cur;
	__u32 off;

	if (old == nw)
		return 0;
	if (p->frag_later) {
		/* no L4 header in this fragment: the first one carried the port */
		*cur = nw;
		return 0;
	}
	if (p->proto == IPPROTO_TCP || p->proto == IPPROTO_UDP) {
		off = p->l4_off + (is_src ? 0 : 2);
	} else if (p->echo) {
		off = p->l4_off + 4; /* the echo identifier */
	} else {
		return -1;
	}
	if (p->csum_off && bpf_l4_csum_replace(skb, p->csum_off, old, nw, p->csum_flags | 2) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, off, &nw, 2, 0) < 0)
		return -1;
	*cur = nw;
	return 0;
}

/* --- lookups --- */

static __always_inline struct ipcache_value *ipcache_get(const union v6addr *addr, __u8 family)
{
	struct ipcache_key k = {};
	k.prefixlen = 8 + 128;
	k.family = family;
	__builtin_memcpy(k.addr, addr->u8, 16);
	return ipcache.lookup(&k);
}

static __always_inline __u32 ipcache_identity(const union v6addr *addr, __u8 family)
{
	struct ipcache_value *v = ipcache_get(addr, family);
	return v ? v->identity : ID_WORLD;
}

/* Identity of a peer address: local endpoint, ipcache, this node, else world. */
static __always_inline __u32 peer_identity(struct dp_config *cfg, const union v6addr *addr,
					   __u8 family, struct endpoint_info *local)
{
	if (local)
		return local->identity;
	__u32 id = ipcache_identity(addr, family);
	if (id == ID_WORLD && cfg &&
	    (addr_eq(addr, &cfg->node_ip4) || addr_eq(addr, &cfg->node_ip6)))
		return ID_HOST;
	return id;
}

/* The source identity of a packet entering a local pod: what from-tunnel
 * read from the VNI (in the mark), else by the source address. */
static __always_inline __u32 ingress_peer(struct __sk_buff *skb, struct dp_config *cfg,
					  struct pkt *p)
{
	__u32 mark = skb->mark;
	if ((mark & MARK_MAGIC_MASK) == MARK_MAGIC_IDENTITY)
		return mark & MARK_IDENTITY_MASK;
	struct endpoint_key sk = {};
	addr_copy(&sk.addr, &p->saddr);
	return peer_identity(cfg, &p->saddr, p->family, endpoints.lookup(&sk));
}

/* 0: allowed, else the drop reason. */
static __always_inline int policy_check(__u64 ep_id, __u32 peer, __u8 dir, struct pkt *p)
{
	struct policy_key k = {};
	k.prefixlen = POLICY_PREFIX_FULL;
	k.identity = peer;
	k.ep_id = ep_id;
	k.dir = dir;
	k.proto = p->proto;
	if (p->proto == IPPROTO_ICMP || p->proto == IPPROTO_ICMPV6)
		k.dport = bpf_htons(ICMP_TYPE_PORT | p->icmp_type);
	else
		k.dport = p->dport;

	struct policy_value *v = policy.lookup(&k);
	__u8 a = v ? v->verdict : 0;
	k.identity = 0;
	v = policy.lookup(&k);
	__u8 b = v ? v->verdict : 0;

	if (a == POLICY_DENY || b == POLICY_DENY)
		return DROP_POLICY_DENY;
	if (a == POLICY_ALLOW || b == POLICY_ALLOW)
		return 0;
	if (a == POLICY_L4_ONLY || b == POLICY_L4_ONLY)
		return DROP_POLICY_L4;
	return DROP_POLICY_L3;
}

/* Kubernetes ipBlocks: does the endpoint's longest prefix holding the peer
 * address allow the packet's protocol and port? */
static __always_inline int prefix_allows(__u64 ep_id, __u8 dir, struct pkt *p,
					 const union v6addr *peer)
{
	struct prefix_policy_key k = {};
	k.dir = dir;
	k.family = p->family;
	k.ep_id = ep_id;
	__builtin_memcpy(k.addr, peer->u8, 16);
	k.prefixlen = PREFIX_POLICY_KEY_BITS + 128;
	struct prefix_policy_value *v = prefix_policy.lookup(&k);
	if (!v)
		return 0;
	__u16 port;
	if (p->proto == IPPROTO_ICMP || p->proto == IPPROTO_ICMPV6)
		port = ICMP_TYPE_PORT | p->icmp_type; /* as the policy map keys ICMP */
	else
		port = bpf_ntohs(p->dport);
	__u32 n = v->count;
	/* A bounded loop (the verifier takes it as is). */
	for (int i = 0; i < PREFIX_POLICY_PORTS; i++) {
		if (i >= n)
			break;
		struct prefix_port *r = &v->ports[i];
		if ((r->proto == 0 || r->proto == p->proto) && r->lo <= port && port <= r->hi)
			return 1;
	}
	return 0;
}

/* policy_check, then (an endpoint with prefix entries, a packet the
 * identities neither allowed nor denied) the prefix entries of the peer
 * address: Kubernetes policy has no deny, an allow of either allows. */
static __always_inline int policy_check_addr(struct endpoint_info *ep, __u32 peer, __u8 dir,
					     struct pkt *p, const union v6addr *peer_addr)
{
	int ret = policy_check(ep->ep_id, peer, dir, p);
	if (ret && ret != DROP_POLICY_DENY && (ep->flags & EP_F_PREFIX_POLICY) &&
	    prefix_allows(ep->ep_id, dir, p, peer_addr))
		return 0;
	return ret;
}

/* --- conntrack --- */

#define CT_NEW 0
#define CT_ESTABLISHED 1
#define CT_REPLY 2

static __always_inline void ct_fill(struct ct_key *k, struct pkt *p, __u8 scope, int reverse)
{
	if (reverse) {
		addr_copy(&k->saddr, &p->daddr);
		addr_copy(&k->daddr, &p->saddr);
		k->sport = p->dport;
		k->dport = p->sport;
	} else {
		addr_copy(&k->saddr, &p->saddr);
		addr_copy(&k->daddr, &p->daddr);
		k->sport = p->sport;
		k->dport = p->dport;
	}
	k->proto = p->proto;
	k->scope = scope;
	k->pad = 0;
}

static __always_inline __u64 ct_lifetime(__u8 proto, __u16 flags)
{
	if (proto != IPPROTO_TCP)
		return CT_LIFETIME_NONTCP;
	if ((flags & CT_F_TX_CLOSING) && (flags & CT_F_RX_CLOSING))
		return CT_LIFETIME_CLOSE;
	if (!(flags & CT_F_REPLY_SEEN))
		return CT_LIFETIME_SYN;
	return CT_LIFETIME_TCP;
}

static __always_inline void ct_touch(struct ct_entry *e, struct pkt *p, int reply, __u64 now)
{
	__u16 f = e->flags;

	if (p->proto == IPPROTO_TCP) {
		if (p->tcp_flags & TCP_RST)
			f |= CT_F_TX_CLOSING | CT_F_RX_CLOSING;
		else if (p->tcp_flags & TCP_FIN)
			f |= reply ? CT_F_RX_CLOSING : CT_F_TX_CLOSING;
		if (!(p->tcp_flags & TCP_SYN))
			f |= CT_F_SEEN_NON_SYN;
	}
	if (reply)
		f |= CT_F_REPLY_SEEN;
	if (f != e->flags)
		e->flags = f;
	__u64 exp = now + ct_lifetime(p->proto, f);
	if (exp < e->expires || exp > e->expires + CT_UPDATE_GRANULARITY)
		e->expires = exp;
}

/* Looks up the packet as the forward direction of fwd_scope, then as a reply
 * of rev_scope. Expired entries count as absent. */
static __always_inline int ct_lookup(struct pkt *p, __u8 fwd_scope, __u8 rev_scope,
				     struct ct_entry **out, __u64 now)
{
	struct ct_key k = {};
	struct ct_entry *e;

	ct_fill(&k, p, fwd_scope, 0);
	e = ct.lookup(&k);
	if (e && e->expires > now) {
		/* A SYN on a connection that closed opens a new one. */
		if (p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN &&
		    (e->flags & (CT_F_TX_CLOSING | CT_F_RX_CLOSING)))
			return CT_NEW;
		ct_touch(e, p, 0, now);
		*out = e;
		return CT_ESTABLISHED;
	}
	ct_fill(&k, p, rev_scope, 1);
	e = ct.lookup(&k);
	if (e && e->expires > now) {
		ct_touch(e, p, 1, now);
		*out = e;
		return CT_REPLY;
	}
	return CT_NEW;
}

static __always_inline int ct_create(struct pkt *p, __u8 scope, __u32 rev_nat_id, __u32 gen,
				     __u32 identity, __u64 now)
{
	struct ct_key k = {};
	struct ct_entry e = {};

	ct_fill(&k, p, scope, 0);
	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & TCP_SYN))
		e.flags = CT_F_SEEN_NON_SYN;
	e.expires = now + ct_lifetime(p->proto, e.flags);
	e.rev_nat_id = rev_nat_id;
	e.policy_gen = gen;
	e.identity = identity;
	return ct.update(&k, &e);
}

/* The packet quoted by an ICMP error (its IP header and first 8 bytes). */
static __always_inline int parse_inner(struct __sk_buff *skb, struct pkt *p, struct pkt *in)
{
	__u32 off = p->l4_off + 8;

	in->family = p->family;
	if (p->family == 4) {
		struct iphdr ip;
		if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)) < 0)
			return -1;
		in->proto = ip.protocol;
		set_v4mapped(&in->saddr, ip.saddr);
		set_v4mapped(&in->daddr, ip.daddr);
		off += (ip.ihl & 0xf) * 4;
	} else {
		struct ipv6hdr ip6;
		if (bpf_skb_load_bytes(skb, off, &ip6, sizeof(ip6)) < 0)
			return -1;
		in->proto = ip6.nexthdr;
		__builtin_memcpy(in->saddr.u8, ip6.saddr.in6_u.u6_addr8, 16);
		__builtin_memcpy(in->daddr.u8, ip6.daddr.in6_u.u6_addr8, 16);
		off += sizeof(struct ipv6hdr);
	}
	__u8 l4[8];
	if (bpf_skb_load_bytes(skb, off, l4, 8) < 0)
		return -1;
	if (in->proto == IPPROTO_TCP || in->proto == IPPROTO_UDP || in->proto == IPPROTO_SCTP) {
		in->sport = *(__be16 *)l4;
		in->dport = *(__be16 *)(l4 + 2);
	} else if (in->proto == IPPROTO_ICMP || in->proto == IPPROTO_ICMPV6) {
		__be16 id = *(__be16 *)(l4 + 4);
		if (l4[0] == ICMP_ECHO || l4[0] == ICMPV6_ECHO_REQUEST)
			in->sport = id;
		else if (l4[0] == ICMP_ECHOREPLY || l4[0] == ICMPV6_ECHO_REPLY)
			in->dport = id;
	}
	return 0;
}

/* An ICMP error about a tracked connection (Cilium's CT_RELATED): the
 * quoted packet travelled the other way, so it is looked up as the forward
 * direction of fwd_scope or a reply of rev_scope. Entries are not touched. */
static __always_inline int icmp_related(struct __sk_buff *skb, struct pkt *p, __u8 fwd_scope,
					__u8 rev_scope, __u64 now)
{
	struct pkt in = {};
	struct ct_key k = {};
	struct ct_entry *e;

	if (!p->icmp_error || parse_inner(skb, p, &in) < 0)
		return 0;
	ct_fill(&k, &in, fwd_scope, 0);
	e = ct.lookup(&k);
	if (e && e->expires > now)
		return 1;
	ct_fill(&k, &in, rev_scope, 1);
	e = ct.lookup(&k);
	return e && e->expires > now;
}

/* --- host firewall (host policies) --- */

static __always_inline int is_node_addr(struct dp_config *cfg, const union v6addr *a)
{
	return (!addr_is_zero(&cfg->node_ip4) && addr_eq(a, &cfg->node_ip4)) ||
	       (!addr_is_zero(&cfg->node_ip6) && addr_eq(a, &cfg->node_ip6));
}

/* Is the packet part of the node's traffic with its control plane (the
 * safety set)? ingress: the packet arrives at the host. */
static __always_inline int host_safe_match(struct pkt *p, int ingress)
{
	struct host_safe_key k = {};
	k.proto = p->proto;
	k.scope = SAFE_REMOTE;
	addr_copy(&k.addr, ingress ? &p->saddr : &p->daddr);
	k.port = ingress ? p->sport : p->dport;
	if (host_safe.lookup(&k))
		return 1;
	__builtin_memset(&k.addr, 0, sizeof(k.addr));
	k.scope = SAFE_ANY_PORT;
	if (host_safe.lookup(&k))
		return 1;
	k.scope = SAFE_LOCAL_PORT;
	k.port = ingress ? p->dport : p->sport;
	return host_safe.lookup(&k) != NULL;
}

/* The node's own packet (ingress: to it; egress: from it) under its host
 * policy: the safety set, conntrack (replies and established connections
 * pass), then the host endpoint's policy for a new connection. 0: pass on;
 * else the packet was dropped (TC_ACT_SHOT). */
static __always_inline int host_firewall(struct __sk_buff *skb, struct dp_config *cfg,
					 struct pkt *p, __u32 peer, int ingress)
{
	__u8 dir = ingress ? DIR_INGRESS : DIR_EGRESS;
	__u8 fwd = ingress ? CT_SCOPE_HOST_IN : CT_SCOPE_HOST_OUT;
	__u8 rev = ingress ? CT_SCOPE_HOST_OUT : CT_SCOPE_HOST_IN;
	__u32 src_id = ingress ? peer : ID_HOST;
	__u32 dst_id = ingress ? ID_HOST : peer;
	__u64 now = bpf_ktime_get_ns();

	__u32 enforced = cfg->flags & (ingress ? CFG_HOST_INGRESS : CFG_HOST_EGRESS);

	if (host_safe_match(p, ingress)) {
		count(dir, REASON_HOST_SAFETY, p->len);
		if (verdict_event(cfg, enforced) && p->proto == IPPROTO_TCP &&
		    (p->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN)
			emit(skb, p, EV_HOST_SAFETY, VERDICT_FORWARDED, 0, dir, HOST_EP_ID, src_id,
			     dst_id);
		return 0;
	}
	if (icmp_related(skb, p, rev, fwd, now))
		return 0;
	struct ct_entry *ce = NULL;
	if (ct_lookup(p, fwd, rev, &ce, now) != CT_NEW)
		return 0;
	if (enforced) {
		int ret = policy_check(HOST_EP_ID, peer, dir, p);
		if (ret)
			return drop(skb, p, ret, dir, HOST_EP_ID, src_id, dst_id);
	}
	if (ct_create(p, fwd, 0, 0, peer, now) < 0)
		return drop(skb, p, DROP_CT_INSERT_FAILED, dir, HOST_EP_ID, src_id, dst_id);
	if (verdict_event(cfg, enforced))
		emit(skb, p, EV_POLICY_VERDICT, VERDICT_FORWARDED, 0, dir, HOST_EP_ID, src_id, dst_id);
	return 0;
}

/* A local pod's new connection to the host (ingress of the host), or the
 * host's to a local pod (its egress): the host endpoint's policy with the
 * pod's identity; the pod's conntrack entry carries the connection. 0 or a
 * drop reason. */
static __always_inline int host_policy_pod(struct dp_config *cfg, __u32 pod_id, __u8 dir,
					   struct pkt *p)
{
	__u32 on = dir == DIR_INGRESS ? CFG_HOST_INGRESS : CFG_HOST_EGRESS;
	if (!cfg || !(cfg->flags & CFG_HOST_POLICY) || !(cfg->flags & on))
		return 0;
	return policy_check(HOST_EP_ID, pod_id, dir, p);
}

/* The node's own packet leaving it (to_netdev, to_tunnel): translated
 * traffic (NodePort SNAT towards a remote backend) is not the host's, and
 * the tunnel's own packets always pass. 0: pass on; else dropped. */
static __always_inline int host_egress(struct __sk_buff *skb, struct dp_config *cfg,
				       struct pkt *p, __u32 peer)
{
	if ((cfg->flags & CFG_TUNNEL) && p->proto == IPPROTO_UDP && p->dport == cfg->tunnel_port)
		return 0;
	struct ct_key nk = {};
	ct_fill(&nk, p, NAT_IN, 1);
	if (snat.lookup(&nk))
		return 0;
	return host_firewall(skb, cfg, p, peer, 0);
}

/* --- load balancing --- */

static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* The Maglev hash of a connection; flagella.datapath.bpf.layout.maglev_hash
 * computes the same value. */
static __always_inline __u32 tuple_hash(struct pkt *p)
{
	__u32 h = 0x9e3779b9;
#pragma unroll
	for (int i = 0; i < 4; i++)
		h = mix32(h ^ p->saddr.u32[i]);
#pragma unroll
	for (int i = 0; i < 4; i++)
		h = mix32(h ^ p->daddr.u32[i]);
	h = mix32(h ^ (((__u32)p->sport << 16) | (__u32)p->dport));
	h = mix32(h ^ (__u32)p->proto);
	return h;
}

static __always_inline int source_range_ok(struct svc_value *svc, struct pkt *p)
{
	struct srcrange_key k = {};
	k.prefixlen = 32 + 8 + 128;
	k.service_id = svc->service_id;
	k.family = p->family;
	__builtin_memcpy(k.addr, p->saddr.u8, 16);
	return srcrange.lookup(&k) != NULL;
}

static __always_inline __u32 select_backend(struct svc_value *svc, struct svc_key *sk, struct pkt *p)
{
	if (svc->flags & SVC_F_MAGLEV) {
		__u32 sid = svc->service_id;
		void *table = maglev.lookup(&sid);
		if (!table)
			return 0;
		__u32 idx = MAGLEV_SIZE_INDEX;
		__u32 *m = bpf_map_lookup_elem(table, &idx);
		if (!m || !*m)
			return 0;
		idx = tuple_hash(p) % *m + 1;
		__u32 *b = bpf_map_lookup_elem(table, &idx);
		return b ? *b : 0;
	}
	sk->slot = (bpf_get_prandom_u32() % svc->count) + 1;
	struct svc_value *s = services.lookup(sk);
	return s ? s->backend_id : 0;
}

/* Whether a backend is one of this node's endpoints. */
static __always_inline int is_local_backend(struct backend_value *be)
{
	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &be->addr);
	return endpoints.lookup(&ek) != NULL;
}

/* Service DNAT. 0 when done (*rev_nat_id and *backend_id set) or not a
 * service (*rev_nat_id stays 0), else a drop reason. nodeport_only: only
 * NodePort frontends count as services (traffic from outside the node). */
static __always_inline int lb_service(struct __sk_buff *skb, struct pkt *p, __u32 *rev_nat_id,
				      __u32 *backend_id, __u64 now, int nodeport_only)
{
	struct svc_key sk = {};

	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return 0;
	addr_copy(&sk.addr, &p->daddr);
	sk.dport = p->dport;
	sk.proto = p->proto;
	struct svc_value *svc = services.lookup(&sk);
	if (!svc)
		return 0;
	if (nodeport_only && !(svc->flags & SVC_F_NODEPORT))
		return 0;
	if ((svc->flags & SVC_F_SOURCE_RANGE) && !source_range_ok(svc, p))
		return DROP_SOURCE_RANGE;
	/* externalTrafficPolicy Local, traffic from outside: this node's own
	 * backends only (Cilium's external scope); none here: dropped as
	 * Cilium drops it (DROP_NO_SERVICE, "no backend"), never sent on. */
	int local_only = nodeport_only && (svc->flags & SVC_F_EXT_LOCAL);
	if (local_only) {
		sk.scope = SVC_SCOPE_LOCAL;
		svc = services.lookup(&sk);
		if (!svc)
			return DROP_NO_BACKEND;
	}

	struct ct_key ck = {};
	struct backend_value *be = NULL;
	__u32 bid = 0;

	ct_fill(&ck, p, CT_SCOPE_SERVICE, 0);
	struct ct_entry *ce = ct.lookup(&ck);
	if (ce && ce->expires > now) {
		bid = ce->backend_id;
		be = backends.lookup(&bid);
		if (be) {
			/* Service entries see one direction only: the lifetime is
			 * that of an established connection until FIN or RST. */
			if (p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_FIN | TCP_RST)))
				ce->flags |= CT_F_TX_CLOSING | CT_F_RX_CLOSING;
			ct_touch(ce, p, 0, now);
		}
	}
	if (!be) {
		struct affinity_key ak = {};
		if (svc->count == 0)
			return DROP_NO_BACKEND;
		bid = 0;
		if (svc->flags & SVC_F_AFFINITY) {
			addr_copy(&ak.client, &p->saddr);
			ak.service_id = svc->service_id;
			struct affinity_value *av = affinity.lookup(&ak);
			if (av && now - av->last_used <= (__u64)svc->affinity_timeout * NSEC) {
				bid = av->backend_id;
				be = backends.lookup(&bid);
				/* A terminating (or otherwise inactive) backend
				 * keeps its connections, not its clients. */
				if (be && be->state != BACKEND_ACTIVE)
					be = NULL;
				/* Local only: a client's backend elsewhere (its
				 * affinity from a pod's connection) is not one. */
				if (be && local_only && !is_local_backend(be))
					be = NULL;
			}
		}
		if (!be) {
			bid = select_backend(svc, &sk, p);
			if (!bid)
				return DROP_NO_BACKEND;
			be = backends.lookup(&bid);
			if (!be)
				return DROP_NO_BACKEND;
		}
		if (svc->flags & SVC_F_AFFINITY) {
			struct affinity_value nv = {};
			nv.last_used = now;
			nv.backend_id = bid;
			affinity.update(&ak, &nv);
		}
		struct ct_entry ne = {};
		ne.flags = CT_F_REPLY_SEEN;
		ne.expires = now + ct_lifetime(p->proto, ne.flags);
		ne.backend_id = bid;
		ne.rev_nat_id = svc->rev_nat_id;
		if (ct.update(&ck, &ne) < 0)
			return DROP_CT_INSERT_FAILED;
	}
	if (addr_is_v4(&be->addr) != (p->family == 4))
		return DROP_NAT_FAILED;
	union v6addr baddr;
	addr_copy(&baddr, &be->addr);
	__be16 bport = be->port;
	if (rewrite_addr(skb, p, 0, &baddr) < 0)
		return DROP_NAT_FAILED;
	if (bport && rewrite_port(skb, p, 0, bport) < 0)
		return DROP_NAT_FAILED;
	*rev_nat_id = svc->rev_nat_id;
	*backend_id = bid;
	return 0;
}

static __always_inline int rev_nat(struct __sk_buff *skb, struct pkt *p, __u32 rev_nat_id)
{
	struct revnat_value *rn = revnat.lookup(&rev_nat_id);
	if (!rn)
		return DROP_NAT_FAILED;
	union v6addr a;
	addr_copy(&a, &rn->addr);
	__be16 port = rn->port;
	if (rewrite_addr(skb, p, 1, &a) < 0)
		return DROP_NAT_FAILED;
	if (port && rewrite_port(skb, p, 1, port) < 0)
		return DROP_NAT_FAILED;
	return 0;
}

/* A router's hop where the datapath forwards past the node's stack: the
 * TTL (IPv4, checksum kept right) or hop limit less one. 0, or -reason: it
 * ran out (no ICMP time exceeded is sent). */
static __always_inline int hop(struct __sk_buff *skb, struct pkt *p)
{
	__u8 ttl;
	__u32 off = ETH_HLEN + (p->family == 4 ? offsetof(struct iphdr, ttl)
					       : offsetof(struct ipv6hdr, hop_limit));
	if (bpf_skb_load_bytes(skb, off, &ttl, 1) < 0)
		return -DROP_INVALID_PACKET;
	if (ttl <= 1)
		return -DROP_TTL_EXCEEDED;
	__u8 nttl = ttl - 1;
	if (p->family == 4) {
		/* ttl and protocol share one 16-bit word of the checksum */
		__u8 proto;
		if (bpf_skb_load_bytes(skb, off + 1, &proto, 1) < 0)
			return -DROP_INVALID_PACKET;
		__be16 old = bpf_htons(((__u16)ttl << 8) | proto);
		__be16 nw = bpf_htons(((__u16)nttl << 8) | proto);
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old, nw, 2) < 0)
			return -DROP_INVALID_PACKET;
	}
	if (bpf_skb_store_bytes(skb, off, &nttl, 1, 0) < 0)
		return -DROP_INVALID_PACKET;
	return 0;
}

/* Local delivery: a hop, Ethernet addresses of the destination pod, then
 * its veth. The TC action, or -reason. */
static __always_inline int redirect_local(struct __sk_buff *skb, struct pkt *p,
					  struct endpoint_info *dst)
{
	__u8 macs[12];
	__builtin_memcpy(macs, dst->mac, 6);
	__builtin_memcpy(macs + 6, dst->node_mac, 6);
	__u32 ifindex = dst->ifindex;
	int ret = hop(skb, p);
	if (ret < 0)
		return ret;
	if (bpf_skb_store_bytes(skb, 0, macs, 12, 0) < 0)
		return -DROP_REDIRECT_FAILED;
	return bpf_redirect(ifindex, 0);
}

/* --- DNS proxy: a pod's DNS assigned to the proxy's socket --- */

#define DNS_PORT 53

/* At each exit of from_container, once the packet is allowed: the DNS of
 * an endpoint with toFQDNs rules is passed on (TC_ACT_UNSPEC, with the
 * mark) to to_proxy, the next filter on the hook, instead of where ret
 * sends it. Checked last, where nothing follows: from_container is near
 * the verifier's limit, and a branch before its tail doubles that tail. */
static __always_inline int dns_pass_on(struct __sk_buff *skb, struct endpoint_info *ep,
				       struct pkt *p, int st, int ret)
{
	if (!(ep->flags & EP_F_DNS_PROXY) || st == CT_REPLY || p->dport != bpf_htons(DNS_PORT) ||
	    (p->proto != IPPROTO_UDP && p->proto != IPPROTO_TCP))
		return ret;
	skb->mark = MARK_MAGIC_TO_PROXY;
	return TC_ACT_UNSPEC;
}

/* --- tunnel mode --- */

static __always_inline int set_tunnel(struct __sk_buff *skb, __be32 node, __u32 identity)
{
	struct bpf_tunnel_key key = {};
	key.remote_ipv4 = bpf_ntohl(node);
	key.tunnel_id = identity & MARK_IDENTITY_MASK;
	key.tunnel_ttl = TUNNEL_TTL;
	return bpf_skb_set_tunnel_key(skb, &key, sizeof(key), BPF_F_ZERO_CSUM_TX);
}

/* A destination in another node's pod CIDR goes into the tunnel, to that
 * node, with the source identity as VNI (as Cilium), one hop on. -1: not a
 * tunnel destination; -reason: dropped; else the redirect's TC action. */
static __always_inline int tunnel_redirect(struct __sk_buff *skb, struct pkt *p,
					   struct dp_config *cfg, __u32 src_identity)
{
	struct ipcache_value *v = ipcache_get(&p->daddr, p->family);
	if (!v || !v->tunnel_ip)
		return -1;
	__be32 node = v->tunnel_ip;
	__u32 ifindex = cfg->tunnel_ifindex;
	int ret = hop(skb, p);
	if (ret < 0)
		return ret;
	if (set_tunnel(skb, node, src_identity) < 0)
		return -DROP_INVALID_PACKET;
	return bpf_redirect(ifindex, 0);
}

/* ------------------------------------------------------------------ */

int from_container(struct __sk_buff *skb)
{
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret == PASS)
		return TC_ACT_OK;
	if (ret < 0)
		return drop(skb, &p, -ret, DIR_EGRESS, 0, 0, 0);

	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &p.saddr);
	struct endpoint_info *ep = endpoints.lookup(&ek);
	if (!ep || ep->ifindex != skb->ifindex) /* not this veth's pod's address */
		return drop(skb, &p, DROP_INVALID_SOURCE_IP, DIR_EGRESS, 0, 0, 0);
	__u64 ep_id = ep->ep_id;
	__u32 my_id = ep->identity;
	if (!(ep->flags & EP_F_POLICY_READY))
		return drop(skb, &p, DROP_POLICY_NOT_READY, DIR_EGRESS, ep_id, my_id, 0);

	__u64 now = bpf_ktime_get_ns();
	__u32 rev_nat_id = 0;
	__u32 backend_id = 0;
	/* An ICMP error about a connection of this pod passes like its replies. */
	int related = icmp_related(skb, &p, CT_SCOPE_INGRESS, CT_SCOPE_EGRESS, now);
	if (!related) {
		ret = lb_service(skb, &p, &rev_nat_id, &backend_id, now, 0);
		if (ret)
			return drop(skb, &p, ret, DIR_EGRESS, ep_id, my_id, 0);
	}
	/* Hairpin: to itself through a service, or its reply to that. A pod
	 * may always reach itself: no policy applies either way. */
	int hairpin = rev_nat_id && p.family == 4 && addr_eq(&p.saddr, &p.daddr);
	int hairpin_reply = is_hairpin_addr(&p.daddr);

	struct endpoint_key dk = {};
	addr_copy(&dk.addr, &p.daddr);
	struct endpoint_info *dst = endpoints.lookup(&dk);
	struct dp_config *cfg = get_config();

	struct ct_entry *ce = NULL;
	int st = related ? CT_REPLY : ct_lookup(&p, CT_SCOPE_EGRESS, CT_SCOPE_INGRESS, &ce, now);
	if (st == CT_ESTABLISHED && ce) {
		if (ce->policy_gen != ep->policy_gen) {
			__u32 peer = peer_identity(cfg, &p.daddr, p.family, dst);
			if ((ep->flags & EP_F_EGRESS_ENFORCED) && !hairpin) {
				ret = policy_check_addr(ep, peer, DIR_EGRESS, &p, &p.daddr);
				if (ret && !audited(skb, &p, ep, ret, DIR_EGRESS, my_id, peer))
					return drop(skb, &p, ret, DIR_EGRESS, ep_id, my_id, peer);
			}
			ce->policy_gen = ep->policy_gen;
		}
	} else if (st == CT_NEW) {
		__u32 peer = peer_identity(cfg, &p.daddr, p.family, dst);
		int audit = 0;
		if ((ep->flags & EP_F_EGRESS_ENFORCED) && !hairpin) {
			ret = policy_check_addr(ep, peer, DIR_EGRESS, &p, &p.daddr);
			if (ret && !(audit = audited(skb, &p, ep, ret, DIR_EGRESS, my_id, peer)))
				return drop(skb, &p, ret, DIR_EGRESS, ep_id, my_id, peer);
		}
		/* To the node's own address: the host's ingress policy too. */
		if (!dst && cfg && (cfg->flags & CFG_HOST_POLICY) && is_node_addr(cfg, &p.daddr)) {
			ret = host_policy_pod(cfg, my_id, DIR_INGRESS, &p);
			if (ret)
				return drop(skb, &p, ret, DIR_INGRESS, HOST_EP_ID, my_id, ID_HOST);
		}
		if (ct_create(&p, CT_SCOPE_EGRESS, rev_nat_id, ep->policy_gen, peer, now) < 0)
			return drop(skb, &p, DROP_CT_INSERT_FAILED, DIR_EGRESS, ep_id, my_id, peer);
		if (!audit && verdict_event(cfg, ep->flags & EP_F_EGRESS_ENFORCED))
			emit(skb, &p, EV_POLICY_VERDICT, VERDICT_FORWARDED, 0, DIR_EGRESS, ep_id, my_id, peer);
	}

	count(DIR_EGRESS, REASON_FORWARDED, p.len);
	if (hairpin) {
		union v6addr loop;
		set_v4mapped(&loop, bpf_htonl(HAIRPIN_V4));
		if (rewrite_addr(skb, &p, 1, &loop) < 0)
			return drop(skb, &p, DROP_NAT_FAILED, DIR_EGRESS, ep_id, my_id, my_id);
	} else if (hairpin_reply && st == CT_REPLY) {
		/* Back to itself, from its own address: the reply's rev-NAT
		 * (in to_container) then gives the service's address. */
		union v6addr self;
		addr_copy(&self, &p.saddr);
		if (rewrite_addr(skb, &p, 0, &self) < 0)
			return drop(skb, &p, DROP_NAT_FAILED, DIR_EGRESS, ep_id, my_id, my_id);
		dst = ep;
	}
	if (dst) {
		__u32 dst_id = dst->identity;
		ret = redirect_local(skb, &p, dst);
		if (ret < 0)
			return drop(skb, &p, -ret, DIR_EGRESS, ep_id, my_id, dst_id);
		return dns_pass_on(skb, ep, &p, st, ret);
	}
	if (cfg && (cfg->flags & CFG_TUNNEL)) {
		ret = tunnel_redirect(skb, &p, cfg, my_id);
		if (ret < -1)
			return drop(skb, &p, -ret, DIR_EGRESS, ep_id, my_id, 0);
		if (ret >= 0)
			return dns_pass_on(skb, ep, &p, st, ret);
	}
	/* Up the host stack (other nodes, outside). The pod addressed its
	 * gateway's MAC, which need not be this veth's. */
	if (skb->pkt_type != PACKET_HOST)
		bpf_skb_change_type(skb, PACKET_HOST);
	return dns_pass_on(skb, ep, &p, st, TC_ACT_OK);
}

int to_container(struct __sk_buff *skb)
{
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret == PASS)
		return TC_ACT_OK;
	if (ret < 0)
		return drop(skb, &p, -ret, DIR_INGRESS, 0, 0, 0);

	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &p.daddr);
	struct endpoint_info *ep = endpoints.lookup(&ek);
	if (!ep || ep->ifindex != skb->ifindex)
		return drop(skb, &p, DROP_UNKNOWN_ENDPOINT, DIR_INGRESS, 0, 0, 0);
	__u64 ep_id = ep->ep_id;
	__u32 my_id = ep->identity;
	if (!(ep->flags & EP_F_POLICY_READY))
		return drop(skb, &p, DROP_POLICY_NOT_READY, DIR_INGRESS, ep_id, 0, my_id);

	__u64 now = bpf_ktime_get_ns();
	struct dp_config *cfg = get_config();
	struct ct_entry *ce = NULL;
	int related = icmp_related(skb, &p, CT_SCOPE_EGRESS, CT_SCOPE_INGRESS, now);
	int st = related ? CT_REPLY : ct_lookup(&p, CT_SCOPE_INGRESS, CT_SCOPE_EGRESS, &ce, now);
	/* The pod itself through a service: from_container's hairpin, which
	 * came in on this very veth (the address from anywhere else is not
	 * trusted: it gets policy like any other). */
	int hairpin = is_hairpin_addr(&p.saddr) && skb->ingress_ifindex == skb->ifindex;

	if (related) {
		/* passes; not translated (see docs: ICMP errors of services) */
	} else if (st == CT_REPLY && ce) {
		__u32 rn = ce->rev_nat_id;
		if (rn) {
			ret = rev_nat(skb, &p, rn);
			if (ret)
				return drop(skb, &p, ret, DIR_INGRESS, ep_id, 0, my_id);
		}
	} else if (st == CT_ESTABLISHED && ce) {
		if (ce->policy_gen != ep->policy_gen) {
			__u32 peer = hairpin ? my_id : ingress_peer(skb, cfg, &p);
			if ((ep->flags & EP_F_INGRESS_ENFORCED) && !hairpin &&
			    !(peer == ID_HOST && cfg && (cfg->flags & CFG_ALLOW_HOST))) {
				ret = policy_check_addr(ep, peer, DIR_INGRESS, &p, &p.saddr);
				if (ret && !audited(skb, &p, ep, ret, DIR_INGRESS, peer, my_id))
					return drop(skb, &p, ret, DIR_INGRESS, ep_id, peer, my_id);
			}
			ce->policy_gen = ep->policy_gen;
		}
	} else {
		__u32 peer = hairpin ? my_id : ingress_peer(skb, cfg, &p);
		/* From the host: the host's egress policy first. */
		if (peer == ID_HOST) {
			ret = host_policy_pod(cfg, my_id, DIR_EGRESS, &p);
			if (ret)
				return drop(skb, &p, ret, DIR_EGRESS, HOST_EP_ID, ID_HOST, my_id);
		}
		int audit = 0;
		if ((ep->flags & EP_F_INGRESS_ENFORCED) && !hairpin &&
		    !(peer == ID_HOST && cfg && (cfg->flags & CFG_ALLOW_HOST))) {
			ret = policy_check_addr(ep, peer, DIR_INGRESS, &p, &p.saddr);
			if (ret && !(audit = audited(skb, &p, ep, ret, DIR_INGRESS, peer, my_id)))
				return drop(skb, &p, ret, DIR_INGRESS, ep_id, peer, my_id);
		}
		if (ct_create(&p, CT_SCOPE_INGRESS, 0, ep->policy_gen, peer, now) < 0)
			return drop(skb, &p, DROP_CT_INSERT_FAILED, DIR_INGRESS, ep_id, peer, my_id);
		if (!audit && verdict_event(cfg, ep->flags & EP_F_INGRESS_ENFORCED))
			emit(skb, &p, EV_POLICY_VERDICT, VERDICT_FORWARDED, 0, DIR_INGRESS, ep_id, peer, my_id);
	}
	count(DIR_INGRESS, REASON_FORWARDED, p.len);
	return TC_ACT_OK;
}

/* The second filter on a pod veth's tc ingress, reached only when
 * from_container passes a packet on (TC_ACT_UNSPEC) marked for the DNS
 * proxy: a query (UDP) or a connection's SYN gets the proxy's listening
 * socket (any address, the proxy's port: as Cilium) assigned; every packet
 * keeps the mark, which routes it locally (an ip rule: dnsproxy), where
 * the rest of a TCP connection finds its socket by its addresses. The
 * original destination stays in the packet: the proxy reads it and
 * answers from it. */
int to_proxy(struct __sk_buff *skb)
{
	if (skb->mark != MARK_MAGIC_TO_PROXY)
		return TC_ACT_OK;
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret == PASS)
		return TC_ACT_OK;
	if (ret < 0)
		return drop(skb, &p, -ret, DIR_EGRESS, 0, 0, 0);
	struct dp_config *cfg = get_config();
	if (!cfg || !cfg->dns_proxy_port)
		return drop(skb, &p, DROP_REDIRECT_FAILED, DIR_EGRESS, 0, 0, 0);
	if (p.proto == IPPROTO_UDP || (p.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN) {
		struct bpf_sock_tuple t = {};
		__u32 len = sizeof(t.ipv6);
		if (p.family == 4) {
			t.ipv4.dport = bpf_htons(cfg->dns_proxy_port);
			len = sizeof(t.ipv4);
		} else {
			t.ipv6.dport = bpf_htons(cfg->dns_proxy_port);
		}
		struct bpf_sock *sk;
		if (p.proto == IPPROTO_UDP)
			sk = bpf_sk_lookup_udp(skb, &t, len, BPF_F_CURRENT_NETNS, 0);
		else
			sk = bpf_sk_lookup_tcp(skb, &t, len, BPF_F_CURRENT_NETNS, 0);
		if (!sk) /* no proxy: never around it */
			return drop(skb, &p, DROP_REDIRECT_FAILED, DIR_EGRESS, 0, 0, 0);
		long r = bpf_sk_assign(skb, sk, 0);
		bpf_sk_release(sk);
		if (r)
			return drop(skb, &p, DROP_REDIRECT_FAILED, DIR_EGRESS, 0, 0, 0);
	}
	if (skb->pkt_type != PACKET_HOST)
		bpf_skb_change_type(skb, PACKET_HOST);
	return TC_ACT_OK;
}

/* ------------------------------------------------------------------ */
/* The node's uplink: masquerade, NodePort from outside. */

static __always_inline __u64 nat_lifetime(__u8 proto)
{
	return proto == IPPROTO_TCP ? CT_LIFETIME_TCP : CT_LIFETIME_NONTCP;
}

static __always_inline int natable(struct pkt *p)
{
	return p->proto == IPPROTO_TCP || p->proto == IPPROTO_UDP || p->echo;
}

/* The NAT_OUT translation of p's tuple to nat_ip and a port, created when
 * missing: the reply tuple as it will arrive (p's destination -> nat_ip,
 * port) is inserted first with BPF_NOEXIST, which reserves the port, with
 * `in` as its value (what the reply's destination becomes). 0 and *port,
 * or -1 (no free port in NAT_PORT_TRIES random tries). */
static __always_inline int nat_out(struct dp_config *cfg, struct pkt *p, union v6addr *nat_ip,
				   struct nat_value *in, __u64 now, __be16 *port)
{
	struct ct_key ok = {};
	ct_fill(&ok, p, NAT_OUT, 0);
	struct nat_value *nv = snat.lookup(&ok);
	if (nv && nv->expires > now) {
		*port = nv->port;
		__u64 exp = now + nat_lifetime(p->proto);
		if (exp > nv->expires + CT_UPDATE_GRANULARITY)
			nv->expires = exp;
		return 0;
	}
	struct ct_key ik = {};
	addr_copy(&ik.saddr, &p->daddr);
	addr_copy(&ik.daddr, nat_ip);
	ik.proto = p->proto;
	ik.scope = NAT_IN;
	/* echo requests: sport = id, dport = 0; the reply carries the id as
	 * dport, like a port */
	ik.sport = p->dport;
	__u32 lo = cfg->nat_port_min;
	__u32 hi = cfg->nat_port_max;
	if (!lo || hi < lo)
		return -1;
	__u32 range = hi - lo + 1;
	__be16 cand = 0;
	int done = 0;
#pragma unroll
	for (int i = 0; i < NAT_PORT_TRIES; i++) {
		if (!done) {
			cand = bpf_htons((__u16)(lo + bpf_get_prandom_u32() % range));
			ik.dport = cand;
			if (snat.insert(&ik, in) == 0)
				done = 1;
		}
	}
	if (!done)
		return -1;
	struct nat_value out = {};
	addr_copy(&out.addr, nat_ip);
	out.port = cand;
	out.flags = in->flags;
	out.expires = in->expires;
	if (snat.update(&ok, &out) < 0) {
		snat.delete(&ik);
		return -1;
	}
	*port = cand;
	return 0;
}

/* Sends a packet the node forwards (NodePort to a remote backend, and its
 * replies back to the client) out of the interface the FIB chooses, with
 * the Ethernet addresses of the FIB's answer, or through the neighbour
 * subsystem when the next hop is not resolved yet. Not up the host stack:
 * the packet's source is the node's own address, which the stack drops as
 * martian on a packet arriving from outside. A TC action, or -reason. */
static __always_inline int fib_redirect(struct __sk_buff *skb, struct pkt *p)
{
	int hopped = hop(skb, p);
	if (hopped < 0)
		return hopped;
	struct bpf_fib_lookup fib = {};
	fib.ifindex = skb->ifindex;
	fib.l4_protocol = p->proto;
	fib.sport = p->sport;
	fib.dport = p->dport;
	if (p->family == 4) {
		fib.family = AF_INET;
		fib.ipv4_src = p->saddr.u32[3];
		fib.ipv4_dst = p->daddr.u32[3];
	} else {
		fib.family = AF_INET6;
		__builtin_memcpy(fib.ipv6_src, p->saddr.u32, 16);
		__builtin_memcpy(fib.ipv6_dst, p->daddr.u32, 16);
	}
	long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		__u8 macs[12];
		__builtin_memcpy(macs, fib.dmac, 6);
		__builtin_memcpy(macs + 6, fib.smac, 6);
		if (bpf_skb_store_bytes(skb, 0, macs, 12, 0) < 0)
			return -DROP_REDIRECT_FAILED;
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {};
		if (p->family == 4) {
			nh.nh_family = AF_INET;
			nh.ipv4_nh = fib.ipv4_dst; /* the next hop, as the FIB returns it */
		} else {
			nh.nh_family = AF_INET6;
			__builtin_memcpy(nh.ipv6_nh, fib.ipv6_dst, 16);
		}
		return redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	return -DROP_FIB_LOOKUP_FAILED;
}

int to_netdev(struct __sk_buff *skb)
{
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret != 0)
		return TC_ACT_OK; /* not ours to judge on the uplink */
	struct dp_config *hc = get_config();
	if (hc && (hc->flags & CFG_HOST_POLICY) && is_node_addr(hc, &p.saddr)) {
		ret = host_egress(skb, hc, &p, ipcache_identity(&p.daddr, p.family));
		return ret ? ret : TC_ACT_OK;
	}
	if (!natable(&p))
		return TC_ACT_OK;
	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &p.saddr);
	struct endpoint_info *ep = endpoints.lookup(&ek);
	if (!ep)
		return TC_ACT_OK; /* the node's own traffic, or forwarded by from-netdev */
	__u64 ep_id = ep->ep_id;
	__u32 my_id = ep->identity;
	__u64 now = bpf_ktime_get_ns();

	/* A local backend's reply to an outside NodePort client leaves with
	 * the frontend (node address, node port) as its source. */
	if (p.proto == IPPROTO_TCP || p.proto == IPPROTO_UDP) {
		struct ct_key nk = {};
		ct_fill(&nk, &p, CT_SCOPE_NODEPORT, 1);
		struct ct_entry *ne = ct.lookup(&nk);
		if (ne && ne->expires > now) {
			ct_touch(ne, &p, 1, now);
			__u32 peer = ne->identity;
			ret = rev_nat(skb, &p, ne->rev_nat_id);
			if (ret)
				return drop(skb, &p, ret, DIR_EGRESS, ep_id, my_id, peer);
			return TC_ACT_OK;
		}
	}

	struct dp_config *cfg = get_config();
	if (!cfg)
		return TC_ACT_OK;
	union v6addr nat_ip;
	if (p.family == 4) {
		if (!(cfg->flags & CFG_MASQUERADE4))
			return TC_ACT_OK;
		addr_copy(&nat_ip, &cfg->node_ip4);
	} else {
		if (!(cfg->flags & CFG_MASQUERADE6))
			return TC_ACT_OK;
		addr_copy(&nat_ip, &cfg->node_ip6);
	}
	if (addr_is_zero(&nat_ip))
		return TC_ACT_OK;
	struct ipcache_value *dv = ipcache_get(&p.daddr, p.family);
	__u32 dst_id = dv ? dv->identity : ID_WORLD;
	if (dv && (dv->flags & IPC_F_CLUSTER))
		return TC_ACT_OK; /* a node or a node's pod CIDR: no masquerade */
	if (dst_id != ID_WORLD && dst_id < ID_LOCAL_SCOPE)
		return TC_ACT_OK; /* inside the cluster: no masquerade */
	/* A reply of a connection opened towards the pod from outside (routed
	 * to it, not translated on the way in) keeps the pod's address. */
	struct ct_key rk = {};
	ct_fill(&rk, &p, CT_SCOPE_INGRESS, 1);
	struct ct_entry *re = ct.lookup(&rk);
	if (re && re->expires > now)
		return TC_ACT_OK;

	struct nat_value in = {};
	addr_copy(&in.addr, &p.saddr);
	in.port = p.sport;
	in.expires = now + nat_lifetime(p.proto);
	__be16 nat_port = 0;
	if (nat_out(cfg, &p, &nat_ip, &in, now, &nat_port) < 0)
		return drop(skb, &p, DROP_NAT_FAILED, DIR_EGRESS, ep_id, my_id, dst_id);
	if (rewrite_addr(skb, &p, 1, &nat_ip) < 0 || rewrite_port(skb, &p, 1, nat_port) < 0)
		return drop(skb, &p, DROP_NAT_FAILED, DIR_EGRESS, ep_id, my_id, dst_id);
	return TC_ACT_OK;
}

/* NodePort from outside the node: DNAT to a backend chosen as for pods
 * (service conntrack, affinity, random or Maglev, source ranges). A local
 * backend is reached by redirect to its veth, whose to-container applies
 * its ingress policy with the client's identity (world, or a CIDR
 * identity); a CT_SCOPE_NODEPORT entry tells to-netdev to reverse-NAT the
 * reply. A remote backend is reached with the node address as source
 * (SNAT, Cilium's default NodePort mode) through the FIB. The TC action,
 * or -1 when the packet is not for a NodePort frontend. */
static __always_inline int nodeport_lb(struct __sk_buff *skb, struct pkt *p, struct dp_config *cfg,
				       union v6addr *node_ip, __u64 now)
{
	__u32 rev_nat_id = 0;
	__u32 backend_id = 0;
	int ret = lb_service(skb, p, &rev_nat_id, &backend_id, now, 1);
	if (ret)
		return drop(skb, p, ret, DIR_INGRESS, 0, ipcache_identity(&p->saddr, p->family), 0);
	if (!rev_nat_id)
		return -1;

	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &p->daddr);
	struct endpoint_info *dst = endpoints.lookup(&ek);
	if (dst) {
		struct ct_key k = {};
		ct_fill(&k, p, CT_SCOPE_NODEPORT, 0);
		struct ct_entry *e = ct.lookup(&k);
		int fresh_syn = p->proto == IPPROTO_TCP &&
				(p->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
		if (e && e->expires > now && e->rev_nat_id == rev_nat_id &&
		    !(fresh_syn && (e->flags & (CT_F_TX_CLOSING | CT_F_RX_CLOSING)))) {
			ct_touch(e, p, 0, now);
		} else {
			struct ct_entry ne = {};
			if (p->proto == IPPROTO_TCP && !(p->tcp_flags & TCP_SYN))
				ne.flags = CT_F_SEEN_NON_SYN;
			ne.expires = now + ct_lifetime(p->proto, ne.flags);
			ne.backend_id = backend_id;
			ne.rev_nat_id = rev_nat_id;
			ne.identity = ipcache_identity(&p->saddr, p->family);
			if (ct.update(&k, &ne) < 0)
				return drop(skb, p, DROP_CT_INSERT_FAILED, DIR_INGRESS, dst->ep_id,
					    ne.identity, dst->identity);
		}
		__u64 dst_ep = dst->ep_id;
		__u32 dst_id = dst->identity;
		ret = redirect_local(skb, p, dst);
		if (ret < 0)
			return drop(skb, p, -ret, DIR_INGRESS, dst_ep, 0, dst_id);
		return ret;
	}

	/* A remote backend: the node's address and a NAT port as source. */
	union v6addr nat_ip;
	addr_copy(&nat_ip, node_ip);
	struct nat_value in = {};
	addr_copy(&in.addr, &p->saddr);
	in.port = p->sport;
	in.flags = NAT_F_NODEPORT;
	in.rev_nat_id = rev_nat_id;
	in.expires = now + nat_lifetime(p->proto);
	__be16 port = 0;
	if (nat_out(cfg, p, &nat_ip, &in, now, &port) < 0)
		return drop(skb, p, DROP_NAT_FAILED, DIR_INGRESS, 0, 0, 0);
	if (rewrite_addr(skb, p, 1, &nat_ip) < 0 || rewrite_port(skb, p, 1, port) < 0)
		return drop(skb, p, DROP_NAT_FAILED, DIR_INGRESS, 0, 0, 0);
	ret = fib_redirect(skb, p);
	if (ret < 0)
		return drop(skb, p, -ret, DIR_INGRESS, 0, 0, 0);
	count(DIR_INGRESS, REASON_FORWARDED, p->len);
	return ret;
}

/* Replies to the node address: masquerade (to the pod) and NodePort SNAT
 * (to the outside client, from the frontend). The TC action, or -1 when
 * the packet is the node's own traffic. */
static __always_inline int rev_snat(struct __sk_buff *skb, struct pkt *p, struct dp_config *cfg,
				    __u64 now)
{
	struct ct_key ik = {};
	ct_fill(&ik, p, NAT_IN, 0);
	struct nat_value *nv = snat.lookup(&ik);
	if (!nv || nv->expires <= now)
		return -1; /* the node's own traffic */
	__u16 flags = nv->flags;
	__u32 masq = p->family == 4 ? CFG_MASQUERADE4 : CFG_MASQUERADE6;
	if (!(flags & NAT_F_NODEPORT) && !(cfg->flags & masq))
		return -1;
	union v6addr to;
	addr_copy(&to, &nv->addr);
	__be16 port = nv->port;
	__u32 rn = nv->rev_nat_id;
	__u64 exp = now + nat_lifetime(p->proto);
	if (exp > nv->expires + CT_UPDATE_GRANULARITY)
		nv->expires = exp;
	if (rewrite_addr(skb, p, 0, &to) < 0 || rewrite_port(skb, p, 0, port) < 0)
		return drop(skb, p, DROP_NAT_FAILED, DIR_INGRESS, 0, 0, 0);

	if (flags & NAT_F_NODEPORT) {
		int ret = rev_nat(skb, p, rn);
		if (ret)
			return drop(skb, p, ret, DIR_INGRESS, 0, 0, 0);
		ret = fib_redirect(skb, p);
		if (ret < 0)
			return drop(skb, p, -ret, DIR_INGRESS, 0, 0, 0);
		count(DIR_INGRESS, REASON_FORWARDED, p->len);
		return ret;
	}

	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &to);
	struct endpoint_info *dst = endpoints.lookup(&ek);
	if (dst) {
		__u64 dst_ep = dst->ep_id;
		__u32 dst_id = dst->identity;
		int ret = redirect_local(skb, p, dst);
		if (ret < 0)
			return drop(skb, p, -ret, DIR_INGRESS, dst_ep, 0, dst_id);
		return ret;
	}
	return TC_ACT_OK;
}

int from_netdev(struct __sk_buff *skb)
{
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret != 0)
		return TC_ACT_OK;
	struct dp_config *cfg = get_config();
	if (!cfg)
		return TC_ACT_OK;
	union v6addr node_ip;
	if (p.family == 4)
		addr_copy(&node_ip, &cfg->node_ip4);
	else
		addr_copy(&node_ip, &cfg->node_ip6);
	if (addr_is_zero(&node_ip))
		return TC_ACT_OK;
	if (!addr_eq(&p.daddr, &node_ip)) {
		/* A LoadBalancer service's external address (LB-IPAM's) is a
		 * node-port frontend of its own: translated as a node port. */
		if (natable(&p)) {
			ret = nodeport_lb(skb, &p, cfg, &node_ip, bpf_ktime_get_ns());
			if (ret >= 0)
				return ret;
		}
		return TC_ACT_OK; /* else only the node address is translated here */
	}
	if ((cfg->flags & CFG_TUNNEL) && p.proto == IPPROTO_UDP && p.dport == cfg->tunnel_port)
		return TC_ACT_OK; /* the tunnel's own packets: not a service's */
	if (natable(&p)) {
		__u64 now = bpf_ktime_get_ns();
		ret = nodeport_lb(skb, &p, cfg, &node_ip, now);
		if (ret >= 0)
			return ret;
		ret = rev_snat(skb, &p, cfg, now);
		if (ret >= 0)
			return ret;
	}
	/* The node's own traffic: its host policy, if it has one. */
	if (cfg->flags & CFG_HOST_POLICY) {
		ret = host_firewall(skb, cfg, &p, ipcache_identity(&p.saddr, p.family), 1);
		if (ret)
			return ret;
	}
	return TC_ACT_OK;
}

/* ------------------------------------------------------------------ */
/* The VXLAN device (tunnel mode). */

/* A packet out of the tunnel: the VNI is the source identity its node
 * gave it (that node's host: remote-node here); only nodes of the cluster
 * may send. A local pod's packet is handed to its veth with the identity in
 * the mark, and its to-container applies the ingress policy; anything else
 * goes up the stack. */
int from_tunnel(struct __sk_buff *skb)
{
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret == PASS)
		return TC_ACT_OK;
	if (ret < 0)
		return drop(skb, &p, -ret, DIR_INGRESS, 0, 0, 0);
	struct bpf_tunnel_key key = {};
	if (bpf_skb_get_tunnel_key(skb, &key, sizeof(key), 0) < 0)
		return drop(skb, &p, DROP_INVALID_PACKET, DIR_INGRESS, 0, 0, 0);
	union v6addr outer;
	set_v4mapped(&outer, bpf_htonl(key.remote_ipv4));
	if (ipcache_identity(&outer, 4) != ID_REMOTE_NODE)
		return drop(skb, &p, DROP_UNKNOWN_NODE, DIR_INGRESS, 0, 0, 0);
	__u32 id = key.tunnel_id;
	if (id == ID_HOST)
		id = ID_REMOTE_NODE;
	else if (id == ID_UNKNOWN)
		id = ID_WORLD;

	struct endpoint_key ek = {};
	addr_copy(&ek.addr, &p.daddr);
	struct endpoint_info *ep = endpoints.lookup(&ek);
	if (!ep) {
		struct dp_config *cfg = get_config();
		if (cfg && (cfg->flags & CFG_HOST_POLICY) && is_node_addr(cfg, &p.daddr)) {
			ret = host_firewall(skb, cfg, &p, id, 1);
			if (ret)
				return ret;
		}
		if (skb->pkt_type != PACKET_HOST)
			bpf_skb_change_type(skb, PACKET_HOST);
		return TC_ACT_OK;
	}
	__u64 ep_id = ep->ep_id;
	__u32 ep_identity = ep->identity;
	skb->mark = MARK_MAGIC_IDENTITY | id;
	ret = redirect_local(skb, &p, ep);
	if (ret < 0)
		return drop(skb, &p, -ret, DIR_INGRESS, ep_id, id, ep_identity);
	return ret;
}

/* Into the tunnel. Pods' packets arrive with their key set (from-container);
 * the node's own (routed to the device: remote pod CIDRs in tunnel mode, and
 * NodePort to remote backends) get the destination's node and the host
 * identity. Neighbour discovery and other link chatter stays here. */
int to_tunnel(struct __sk_buff *skb)
{
	struct bpf_tunnel_key key = {};
	if (bpf_skb_get_tunnel_key(skb, &key, sizeof(key), 0) == 0)
		return TC_ACT_OK;
	struct pkt p = {};
	int ret = parse(skb, &p);
	if (ret != 0)
		return TC_ACT_SHOT;
	struct ipcache_value *v = ipcache_get(&p.daddr, p.family);
	if (!v || !v->tunnel_ip)
		return drop(skb, &p, DROP_NO_TUNNEL_ENDPOINT, DIR_EGRESS, 0, ID_HOST, 0);
	struct dp_config *cfg = get_config();
	if (cfg && (cfg->flags & CFG_HOST_POLICY) && is_node_addr(cfg, &p.saddr)) {
		__be32 tip = v->tunnel_ip;
		ret = host_egress(skb, cfg, &p, v->identity);
		if (ret)
			return ret;
		if (set_tunnel(skb, tip, ID_HOST) < 0)
			return drop(skb, &p, DROP_INVALID_PACKET, DIR_EGRESS, 0, ID_HOST, 0);
		return TC_ACT_OK;
	}
	if (set_tunnel(skb, v->tunnel_ip, ID_HOST) < 0)
		return drop(skb, &p, DROP_INVALID_PACKET, DIR_EGRESS, 0, ID_HOST, 0);
	return TC_ACT_OK;
}

/* --- The XDP prefilter (layouts: prefilter.h) --- */
#include "prefilter.h"

/* CIDR -> its counter slot (index of prefilter_drops). */
BPF_F_TABLE("lpm_trie", struct prefilter_key4, __u32, prefilter_v4, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("lpm_trie", struct prefilter_key6, __u32, prefilter_v6, COMPILE_MAX, BPF_F_NO_PREALLOC);
BPF_TABLE("percpu_array", __u32, struct prefilter_count, prefilter_drops, COMPILE_MAX);

/* XDP of each prefilter device (--prefilter-devices): a packet whose
 * source is in a listed CIDR is counted and dropped before the stack (and
 * tc) sees it; everything else passes. */
int xdp_prefilter(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u32 *slot = NULL;

	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		struct prefilter_key4 k4 = {.prefixlen = 32};

		if ((void *)(ip + 1) > end)
			return XDP_PASS;
		__builtin_memcpy(k4.addr, &ip->saddr, 4);
		slot = prefilter_v4.lookup(&k4);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		struct prefilter_key6 k6 = {.prefixlen = 128};

		if ((void *)(ip6 + 1) > end)
			return XDP_PASS;
		__builtin_memcpy(k6.addr, &ip6->saddr, 16);
		slot = prefilter_v6.lookup(&k6);
	}
	if (!slot)
		return XDP_PASS;
	__u32 index = *slot;
	struct prefilter_count *count = prefilter_drops.lookup(&index);
	if (count) {
		count->packets++;
		count->bytes += (__u64)(end - data);
	}
	return XDP_DROP;
}
