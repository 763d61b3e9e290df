// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Bistouri's BPF programs, one object: the entry points. What they share
 * lives in headers, one per concern, included in this order:
 *   bistouri.h        the structs, enums and limits shared with user space
 *                     (mirrored in bistouri/bpf/abi.py, checked against this object's BTF);
 *   core_fixes.bpf.h  one CO-RE fallback per kernel change;
 *   unwind_rule.h     the walk's registers and rule, the x86-64 frame offsets (pure C);
 *   maps.bpf.h        every map, the options (cfg) and the counters;
 *   unwind.bpf.h      the user-stack walk from .eh_frame rules (walk_user), whose
 *                     step, unwind_step.h, is pure C also built for the unit tests;
 *   python.bpf.h      the CPython frame chain of the sampled thread (walk_python);
 *   stack.bpf.h       a stack event filled (kernel + user stack) and emitted;
 *   recorder.bpf.h    where a finished wait goes: the ring, or the flight recorder's
 *                     counts in the kernel (a process no session samples);
 *   episode.bpf.h     the off-CPU and episode state kept by the scheduler hooks.
 *
 * The programs:
 *   handle_perf, handle_perf_fp   on-CPU samples (perf_event), with tables or frame pointers only;
 *   handle_sched_switch, handle_offcpu_wakeup
 *                                 off-CPU (D-state) waits of watched processes, switch-out to wakeup;
 *   handle_exec                   exec discovery: comms matching a rule are reported;
 *   handle_episode_*, handle_*reclaim_*, handle_compaction_*
 *                                 the episode report: a victim's time by state.
 * Those that take a stack have two twins for kernels without the table walk's
 * features, which the loader chooses (bistouri/bpf/features.py): *_bounded
 * (5.12-5.16: the same walks as bounded loops) and *_compat (5.10, 5.11: frame
 * pointers only); fill_stacks' STACK_BOUNDED and STACK_FP.
 * All are blind until user space fills the maps: the pid filter (which tgids
 * to sample, and how) and the comm trie (which comms to report at exec).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "bistouri.h"
#include "core_fixes.bpf.h"
#include "unwind_rule.h"
#include "maps.bpf.h"
#include "unwind.bpf.h"
#include "python.bpf.h"
#include "stack.bpf.h"
#include "recorder.bpf.h"
#include "episode.bpf.h"

/* ---- On-CPU samples ---- */

/* One on-CPU sample, its user stack taken as `how` says (fill_stacks). */
static __always_inline int sample_on_cpu(struct bpf_perf_event_data *ctx, int how)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	struct bistouri_sample_key key = {};
	struct bistouri_stack_event *ev;
	__u32 slot = SCRATCH_ON_CPU;
	__u64 zero = 0, *seen;
	bool marked = false, wake, changed;
	__u8 one = 1;
	__u32 *flags, divisor;

	/* The filter comes first: this runs on every CPU at the sampling rate. */
	flags = bpf_map_lookup_elem(&pid_filter, &tgid);
	if (!flags || !(*flags & BISTOURI_FILTER_ON_CPU))
		return 0;
	divisor = (*flags >> BISTOURI_FILTER_DIVISOR_SHIFT) & 0xff;
	if (divisor > 1) {
		/* The flight recorder's rate: one sample in `divisor` of this process. */
		__sync_fetch_and_add(flags, 1U << BISTOURI_FILTER_SEEN_SHIFT);
		if ((*flags >> BISTOURI_FILTER_SEEN_SHIFT) % divisor)
			return 0;
	}

	ev = bpf_map_lookup_elem(&scratch, &slot);
	if (!ev)
		return 0;
	fill_header(ev, BISTOURI_EVENT_ON_CPU, pid_tgid, bpf_ktime_get_ns());
	fill_stacks(ctx, ev, 0, ctx, how);
	count(BISTOURI_CNT_ON_CPU_SAMPLES);
	changed = maps_changed(ev, &wake);

	/*
	 * Cut short while the process asks for raw copies (its tables are not in
	 * yet): sent as a copy of its stack, never counted as a repeat (the
	 * truncated stacks of many paths hash alike). The compat twin has no user
	 * registers to send.
	 */
	if (how != STACK_FP && (*flags & BISTOURI_FILTER_RAW_STACK) && walk_cut_short(ev, how) &&
	    emit_raw_stack(ctx, ev, how, wake))
		return 0;

	/*
	 * A repeat of a sample user space holds (same thread, kernel stack and
	 * user stack) only adds to a count: a CPU-bound loop then costs user
	 * space one event per distinct stack instead of one per sample.
	 */
	if (changed) {
		/* Sent whole (not counted) and, unless it happens all the time, with a wakeup. */
		emit_stack(ev, wake ? BPF_RB_FORCE_WAKEUP : wakeup_flags());
		return 0;
	}
	key.tid = ev->tid;
	key.kernel_hash = ev->kernel_hash;
	key.user = ev->user_key;
	if (bpf_map_lookup_elem(&known_samples, &key)) {
		seen = bpf_map_lookup_elem(&on_cpu_counts, &key);
		if (!seen) {
			/* First repeat since the last drain (or another CPU's, if it won). */
			bpf_map_update_elem(&on_cpu_counts, &key, &zero, BPF_NOEXIST);
			seen = bpf_map_lookup_elem(&on_cpu_counts, &key);
		}
		if (seen) {
			__sync_fetch_and_add(seen, 1);
			return 0;
		}
		/* The count map is full: send this one whole. */
	} else {
		marked = !bpf_map_update_elem(&known_samples, &key, &one, BPF_ANY);
	}
	if (!emit_stack(ev, wakeup_flags()) && marked) /* its repeats would have no stack to count into */
		bpf_map_delete_elem(&known_samples, &key);
	return 0;
}

SEC("perf_event")
int handle_perf(struct bpf_perf_event_data *ctx)
{
	return sample_on_cpu(ctx, STACK_TABLES);
}

/* handle_perf for kernels without the table walk's features (fill_stacks: STACK_FP, STACK_BOUNDED). */
SEC("perf_event")
int handle_perf_compat(struct bpf_perf_event_data *ctx)
{
	return sample_on_cpu(ctx, STACK_FP);
}

SEC("perf_event")
int handle_perf_bounded(struct bpf_perf_event_data *ctx)
{
	return sample_on_cpu(ctx, STACK_BOUNDED);
}

/*
 * `record`'s first sampler (ProfilerOptions.sampler_first): frame pointers only,
 * so the verifier passes it in ~2 ms where handle_perf takes ~10, and nothing is
 * lost by that: a process's unwind tables are not loaded in its first tenth of a
 * second anyway. Once the companion object has loaded handle_perf, user space
 * puts it in sampler_handoff and every sample goes on there.
 */
SEC("perf_event")
int handle_perf_fp(struct bpf_perf_event_data *ctx)
{
	bpf_tail_call(ctx, &sampler_handoff, 0);
	return sample_on_cpu(ctx, STACK_FP_BARE); /* slot 0 still empty */
}

/* ---- Off-CPU waits and exec discovery ---- */

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_sched_switch, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	/* In the tracepoint, current is still prev: its stack is the one to take. */
	if (!preempt)
		start_wait(ctx, prev, bpf_ktime_get_ns(), STACK_TABLES);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_sched_switch_compat, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	if (!preempt)
		start_wait(ctx, prev, bpf_ktime_get_ns(), STACK_FP);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_sched_switch_bounded, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	if (!preempt)
		start_wait(ctx, prev, bpf_ktime_get_ns(), STACK_BOUNDED);
	return 0;
}

/*
 * A D wait ends at its wakeup, not at the switch-in: what follows is waiting
 * for a CPU (the episode's run-queue time), which a loaded machine makes long.
 */
SEC("tp_btf/sched_wakeup")
int BPF_PROG(handle_offcpu_wakeup, struct task_struct *p)
{
	finish_wait(p, bpf_ktime_get_ns());
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(handle_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	struct bistouri_comm_key key = { .prefixlen = BISTOURI_COMM_LEN * 8 };
	struct bistouri_exec_event *ev;
	__u32 *rule_id;

	/* The new comm is already set when the exec tracepoint fires. */
	bpf_get_current_comm(key.comm, sizeof(key.comm));
	rule_id = bpf_map_lookup_elem(&comm_rules, &key);
	if (!rule_id)
		return 0;

	ev = bpf_ringbuf_reserve(&exec_events, sizeof(*ev), 0);
	if (!ev) {
		report_error(BISTOURI_CNT_EXEC_RESERVE_FAILED, bpf_get_current_pid_tgid() >> 32, 0);
		return 0;
	}
	ev->rule_id = *rule_id;
	ev->pid = bpf_get_current_pid_tgid() >> 32;
	ev->cgroup_id = bpf_get_current_cgroup_id();
	__builtin_memcpy(ev->comm, key.comm, sizeof(ev->comm));
	count(BISTOURI_CNT_EXEC_MATCHES);
	bpf_ringbuf_submit(ev, 0);
	return 0;
}

/* ---- The episode report (episode.bpf.h) ---- */

/* The scheduler's switch for the episode report, stacks taken as `how` says. */
static __always_inline int episode_switch(void *ctx, bool preempt, struct task_struct *prev,
					  struct task_struct *next, int how)
{
	struct bistouri_thread_times *t;
	__u32 tgid, tid, take = 0, waits = 1;
	__u64 now = 0;
	long state;

	/* prev is current: account its CPU time and the state it leaves in. */
	tgid = BPF_CORE_READ(prev, tgid);
	if (episode_watched(tgid)) {
		now = bpf_ktime_get_ns(); /* only for watched threads: the rest pay two lookups */
		tid = BPF_CORE_READ(prev, pid);
		t = thread_entry(tgid, tid, prev);
		if (t) {
			episode_count(BISTOURI_EPC_SWITCHES);
			close_state(t, now);
			state = get_task_state(prev);
			if (state & TASK_DEAD) {
				/* Its last switch: nothing more to time (the entry stays for the final read). */
				t->state = BISTOURI_STATE_UNKNOWN;
			} else if (preempt || state == 0) {
				t->state = BISTOURI_STATE_RUNNABLE;
				if (runqueue_stack_due(tgid, now))
					take = BISTOURI_EVENT_RUNQUEUE;
			} else if ((state & TASK_UNINTERRUPTIBLE) && !(state & TASK_NOLOAD)) {
				t->state = BISTOURI_STATE_BLOCKED_D;
			} else {
				/* TASK_INTERRUPTIBLE, or an idle (NOLOAD) wait: not a D stall. */
				t->state = BISTOURI_STATE_BLOCKED_S;
				if (state & TASK_INTERRUPTIBLE) {
					waits = stack_due(t, now);
					if (waits)
						take = BISTOURI_EVENT_SLEEP;
				}
			}
			t->since_ns = now;
			/* One call site: the stack walk is inlined once in this program. */
			if (take)
				take_stack(ctx, t, &wait_pending, take, waits, now, how);
		}
	}

	tgid = BPF_CORE_READ(next, tgid);
	if (!episode_watched(tgid))
		return 0;
	if (!now)
		now = bpf_ktime_get_ns();
	tid = BPF_CORE_READ(next, pid);
	t = thread_entry(tgid, tid, next);
	if (!t)
		return 0;
	if (t->state == BISTOURI_STATE_BLOCKED_S)
		send_pending(&wait_pending, tid, now); /* woken without a wakeup we saw */
	if (t->state != BISTOURI_STATE_UNKNOWN)
		close_state(t, now);
	t->state = BISTOURI_STATE_RUNNING;
	t->since_ns = now;
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_episode_switch, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	return episode_switch(ctx, preempt, prev, next, STACK_TABLES);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_episode_switch_compat, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	return episode_switch(ctx, preempt, prev, next, STACK_FP);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_episode_switch_bounded, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	return episode_switch(ctx, preempt, prev, next, STACK_BOUNDED);
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(handle_episode_wakeup, struct task_struct *p)
{
	episode_wakeup(p, false);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(handle_episode_wakeup_new, struct task_struct *p)
{
	episode_wakeup(p, true);
	return 0;
}

SEC("tp_btf/mm_vmscan_direct_reclaim_begin")
int BPF_PROG(handle_direct_reclaim_begin)
{
	reclaim_begin(ctx, STACK_TABLES);
	return 0;
}

SEC("tp_btf/mm_vmscan_direct_reclaim_begin")
int BPF_PROG(handle_direct_reclaim_begin_compat)
{
	reclaim_begin(ctx, STACK_FP);
	return 0;
}

SEC("tp_btf/mm_vmscan_direct_reclaim_begin")
int BPF_PROG(handle_direct_reclaim_begin_bounded)
{
	reclaim_begin(ctx, STACK_BOUNDED);
	return 0;
}

SEC("tp_btf/mm_vmscan_direct_reclaim_end")
int BPF_PROG(handle_direct_reclaim_end)
{
	reclaim_end();
	return 0;
}

/* memory.high and memory.max make the allocating thread reclaim its own cgroup. */
SEC("tp_btf/mm_vmscan_memcg_reclaim_begin")
int BPF_PROG(handle_memcg_reclaim_begin)
{
	reclaim_begin(ctx, STACK_TABLES);
	return 0;
}

SEC("tp_btf/mm_vmscan_memcg_reclaim_begin")
int BPF_PROG(handle_memcg_reclaim_begin_compat)
{
	reclaim_begin(ctx, STACK_FP);
	return 0;
}

SEC("tp_btf/mm_vmscan_memcg_reclaim_begin")
int BPF_PROG(handle_memcg_reclaim_begin_bounded)
{
	reclaim_begin(ctx, STACK_BOUNDED);
	return 0;
}

SEC("tp_btf/mm_vmscan_memcg_reclaim_end")
int BPF_PROG(handle_memcg_reclaim_end)
{
	reclaim_end();
	return 0;
}

SEC("tp_btf/mm_compaction_begin")
int BPF_PROG(handle_compaction_begin)
{
	reclaim_begin(ctx, STACK_TABLES);
	return 0;
}

SEC("tp_btf/mm_compaction_begin")
int BPF_PROG(handle_compaction_begin_compat)
{
	reclaim_begin(ctx, STACK_FP);
	return 0;
}

SEC("tp_btf/mm_compaction_begin")
int BPF_PROG(handle_compaction_begin_bounded)
{
	reclaim_begin(ctx, STACK_BOUNDED);
	return 0;
}

SEC("tp_btf/mm_compaction_end")
int BPF_PROG(handle_compaction_end)
{
	reclaim_end();
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
