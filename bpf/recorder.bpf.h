/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Where a finished wait goes (issue 22): the ring, or the flight recorder's
 * counts in the kernel.
 *
 * A process only the flight recorder watches (pid_filter flag
 * BISTOURI_FILTER_RECORDED, set by user space while no session samples it) has
 * its wait stacks (D, S, reclaim, run-queue) counted into recorder_waits instead
 * of sent: one entry per thread, wait kind and stack, holding the waits of each
 * of the last BISTOURI_RECORDER_SLOTS seconds. Idle JVMs wake hundreds of times
 * a second between them, always at the same few places; each record sent cost
 * user space ~26 us to decode and hold, for samples no session may ever want.
 * User space reads the entries of a session's processes when the session
 * starts (Profiler.recorded_waits), never in between: the entries are bounded
 * by the LRU map (a stack not seen for the longest goes first) and their slots
 * by time.
 * Waits with Python frames are still sent: their frames are named as they
 * arrive, while the code objects are there to read.
 */
#ifndef BISTOURI_RECORDER_BPF_H
#define BISTOURI_RECORDER_BPF_H

#define RECORDER_SLOT_NS 1000000000ULL

/* struct bistouri_recorder_key -> struct bistouri_recorded_wait (bistouri.h). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 2048);
	__type(key, struct bistouri_recorder_key);
	__type(value, struct bistouri_recorded_wait);
} recorder_waits SEC(".maps");

/* A new entry is built here (too large for the BPF stack). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bistouri_recorded_wait);
} recorder_scratch SEC(".maps");

/* enum bistouri_recorder_counter -> count. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, BISTOURI_RC_MAX);
	__type(key, __u32);
	__type(value, __u64);
} recorder_counters SEC(".maps");

enum bistouri_recorder_counter abi_anchor_recorder_counter SEC(".bss");

static __always_inline void recorder_count(__u32 which)
{
	__u64 *val = bpf_map_lookup_elem(&recorder_counters, &which);

	if (val)
		*val += 1;
}

/* Whether `ev` is the recorder's to count: its process is only recorded, and it has no Python frames. */
static __always_inline bool recorder_keeps(struct bistouri_stack_event *ev)
{
	__u32 pid = ev->pid;
	__u32 *flags = bpf_map_lookup_elem(&pid_filter, &pid);

	return flags && (*flags & BISTOURI_FILTER_RECORDED) && !ev->py_depth;
}

/* Count the finished wait `ev` (standing for ev->waits waits of ev->blocked_ns each) into its entry. */
static __always_inline void recorder_add(struct bistouri_stack_event *ev, __u64 now)
{
	struct bistouri_recorder_key key = {
		.tid = ev->tid,
		.kind = ev->kind,
		.kernel_hash = ev->kernel_hash,
		.user_key = ev->user_key,
	};
	struct bistouri_recorded_wait *w;
	struct bistouri_recorder_slot *slot;
	__u32 second = now / RECORDER_SLOT_NS, zero = 0;

	w = bpf_map_lookup_elem(&recorder_waits, &key);
	if (!w) {
		w = bpf_map_lookup_elem(&recorder_scratch, &zero);
		if (!w)
			return;
		__builtin_memset(w->slots, 0, sizeof(w->slots));
		bpf_probe_read_kernel(w->event, sizeof(w->event), ev);
		/* NOEXIST: another CPU may have created it meanwhile; the lookup below finds either. */
		if (!bpf_map_update_elem(&recorder_waits, &key, w, BPF_NOEXIST))
			recorder_count(BISTOURI_RC_ENTRIES);
		w = bpf_map_lookup_elem(&recorder_waits, &key);
		if (!w) {
			recorder_count(BISTOURI_RC_REFUSED);
			return;
		}
	}
	slot = &w->slots[second & (BISTOURI_RECORDER_SLOTS - 1)];
	if (slot->second != second) { /* a slot last used BISTOURI_RECORDER_SLOTS seconds ago or more */
		slot->second = second;
		slot->waits = 0;
		slot->blocked_ns = 0;
	}
	__sync_fetch_and_add(&slot->waits, ev->waits);
	__sync_fetch_and_add(&slot->blocked_ns, ev->blocked_ns * ev->waits);
	recorder_count(BISTOURI_RC_KEPT);
}

/* A finished wait, timed (blocked_ns the mean of its `waits`): counted by the recorder or sent. */
static __always_inline bool send_wait(struct bistouri_stack_event *ev)
{
	if (recorder_keeps(ev)) {
		recorder_add(ev, bpf_ktime_get_ns());
		return true;
	}
	return emit_stack(ev, wakeup_flags());
}

/* A pending wait's stack that ends at `now`, timed from when it was taken: counted or sent. */
static __always_inline bool send_timed_wait(struct bistouri_stack_event *pending, __u64 now)
{
	pending->blocked_ns = now > pending->timestamp_ns ? now - pending->timestamp_ns : 0;
	return send_wait(pending);
}

#endif /* BISTOURI_RECORDER_BPF_H */
