/* flagella XDP prefilter (Cilium's prefilter: cilium_cidr_v4_dyn/v6_dyn):
 * layouts of its maps, mirrored by flagella.datapath.bpf.prefilter. The
 * program and the maps are at the end of datapath.c (bcc rewrites map
 * calls in the main file only): one bcc compile, one program cache entry.
 *
 * Its maps live outside the versioned datapath layout (their own pin
 * folder, PIN_FOLDER in prefilter.py), so adding or resizing them never
 * moves conntrack and the other pinned maps to a new folder. See
 * docs/datapath-bpf.md "XDP prefilter".
 */
#ifndef FLAGELLA_PREFILTER_H
#define FLAGELLA_PREFILTER_H

/* LPM keys: prefix length, then the address in network order. */
struct prefilter_key4 {
	__u32 prefixlen;
	__u8 addr[4];
};

struct prefilter_key6 {
	__u32 prefixlen;
	__u8 addr[16];
};

/* Drop counter of one listed CIDR (per CPU; summed by the reader). */
struct prefilter_count {
	__u64 packets;
	__u64 bytes;
};

#endif
