/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * What the scheduler and reclaim hooks do, apart from their entry points
 * (bistouri.bpf.c):
 *  - off-CPU waits (handle_sched_switch, handle_offcpu_wakeup): a watched
 *    thread's uninterruptible (D) sleeps, their stack taken at switch-out and
 *    sent at wakeup, timed;
 *  - the episode report (handle_episode_*, handle_*reclaim*, handle_compaction_*):
 *    every state a watched thread is in, timed, with stacks of its waits.
 */
#ifndef BISTOURI_EPISODE_BPF_H
#define BISTOURI_EPISODE_BPF_H

/* Task states, as include/linux/sched.h defines them (__state / state). */
#define TASK_INTERRUPTIBLE 0x1
#define TASK_UNINTERRUPTIBLE 0x2
#define TASK_DEAD 0x80
#define TASK_NOLOAD 0x400

/* ---- Off-CPU waits (D state) ---- */

/*
 * Read, then subtract what was read: what other CPUs add meanwhile stays for
 * the next reader (plain XADD, no BPF v3 atomics). Two readers at once may both
 * subtract and leave the value negative: that reads as nothing until new adds
 * fill the hole, so a race loses a little and never inflates a weight.
 */
static __always_inline __s64 take_all(__s64 *v)
{
	__s64 got = *(volatile __s64 *)v;

	if (got <= 0)
		return 0;
	__sync_fetch_and_add(v, -got);
	return got;
}

/* A wait the rate limit skipped ends (woken): add it to what the next capture stands for. */
static __always_inline void finish_skipped(__u32 tid, __u32 tgid, __u64 now)
{
	__u64 *began = bpf_map_lookup_elem(&offcpu_skipped, &tid);
	struct offcpu_limit *limit;
	__u64 blocked;

	if (!began)
		return;
	blocked = now > *began ? now - *began : 0;
	bpf_map_delete_elem(&offcpu_skipped, &tid);
	if (blocked < cfg.offcpu_min_ns)
		return;
	limit = bpf_map_lookup_elem(&offcpu_last, &tgid);
	if (!limit)
		return;
	__sync_fetch_and_add(&limit->skipped, 1);
	__sync_fetch_and_add(&limit->skipped_ns, blocked);
}

/*
 * The woken thread has a pending wait: time it and emit it, standing for the
 * skipped waits it carries. Its blocked_ns is the mean of the `waits` it
 * stands for (as a run-queue stack's), so blocked_ns * waits is their time.
 */
static __always_inline void finish_wait(struct task_struct *woken, __u64 now)
{
	__u32 tid = BPF_CORE_READ(woken, pid);
	struct bistouri_stack_event *pending;
	struct offcpu_limit *limit;
	__u64 blocked, carried;

	pending = bpf_map_lookup_elem(&offcpu_pending, &tid);
	if (!pending) {
		finish_skipped(tid, BPF_CORE_READ(woken, tgid), now);
		return;
	}
	blocked = now > pending->timestamp_ns ? now - pending->timestamp_ns : 0;
	carried = pending->blocked_ns; /* the skipped waits' time, set by start_wait */
	if (blocked < cfg.offcpu_min_ns) {
		count(BISTOURI_CNT_OFFCPU_TOO_SHORT);
		/* Not a wait: what it carried goes to the next capture. */
		limit = bpf_map_lookup_elem(&offcpu_last, &pending->pid);
		if (limit && pending->waits > 1) {
			__sync_fetch_and_add(&limit->skipped, pending->waits - 1);
			__sync_fetch_and_add(&limit->skipped_ns, carried);
		}
	} else {
		pending->blocked_ns = (blocked + carried) / (pending->waits ? pending->waits : 1);
		if (send_wait(pending))
			count(BISTOURI_CNT_OFF_CPU_SAMPLES);
	}
	bpf_map_delete_elem(&offcpu_pending, &tid);
}

/* A filtered thread goes to sleep uninterruptibly: capture its stack now. */
static __always_inline void start_wait(void *ctx, struct task_struct *prev, __u64 now, int how)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	__u32 tid = (__u32)pid_tgid;
	struct bistouri_stack_event *ev;
	struct offcpu_limit *limit;
	__u32 *flags, slot = SCRATCH_OFF_CPU;
	__s64 skipped = 0, skipped_ns = 0;
	long state;

	flags = bpf_map_lookup_elem(&pid_filter, &tgid);
	if (!flags || !(*flags & BISTOURI_FILTER_OFF_CPU))
		return;
	state = get_task_state(prev);
	if (!(state & TASK_UNINTERRUPTIBLE) || (state & TASK_NOLOAD))
		return;

	/*
	 * Rate limit per process before the expensive part: an fsync storm
	 * switches tens of thousands of times a second, and a build-id stack
	 * capture at each one took 22 % of a CPU (measured). A skipped wait is
	 * still timed (finish_skipped), for the next capture to carry.
	 */
	limit = bpf_map_lookup_elem(&offcpu_last, &tgid);
	if (limit && now - limit->last_ns < cfg.offcpu_interval_ns) {
		bpf_map_update_elem(&offcpu_skipped, &tid, &now, BPF_ANY);
		count(BISTOURI_CNT_OFFCPU_RATE_LIMITED);
		return;
	}
	if (limit) {
		skipped = take_all(&limit->skipped);
		skipped_ns = skipped ? take_all(&limit->skipped_ns) : 0;
		limit->last_ns = now;
	} else {
		struct offcpu_limit fresh = { .last_ns = now };

		bpf_map_update_elem(&offcpu_last, &tgid, &fresh, BPF_NOEXIST);
	}

	ev = bpf_map_lookup_elem(&scratch, &slot);
	if (!ev)
		return;
	fill_header(ev, BISTOURI_EVENT_OFF_CPU, pid_tgid, now);
	ev->waits = 1 + (__u32)(skipped < 0xfffffffeLL ? skipped : 0xfffffffeLL);
	fill_stacks(ctx, ev, cfg.tp_btf_skip, NULL, how);
	ev->blocked_ns = skipped_ns; /* carried until finish_wait adds this wait's own time */
	/*
	 * The wait started at the switch (fill_header's `now`), as the kernel's
	 * own accounting and the episode hooks have it: the walk above delays the
	 * switch, not the thread, which was dequeued already.
	 */
	if (bpf_map_update_elem(&offcpu_pending, &tid, ev, BPF_ANY))
		report_error(BISTOURI_CNT_OFFCPU_PENDING_FULL, tgid, 0);
}

/*
 * ---- Episode report (issue 12): victims' time by state. ----
 * Programs of their own on the scheduler tracepoints, apart from the off-CPU
 * sampler's (handle_sched_switch, handle_offcpu_wakeup). Every hook looks up the tgid in pid_filter first and returns
 * unless BISTOURI_EPISODE_FILTER_ON is set: an unwatched thread costs one hash lookup (none for the idle task).
 * State machine per thread, timed at each transition:
 *   switch-out: RUNNING -> RUNNABLE (preempted or still TASK_RUNNING), D or S
 *   wakeup:     D/S -> RUNNABLE (the wait ends: blocked time by state)
 *   switch-in:  RUNNABLE -> RUNNING (run-queue delay, as schedstat's run_delay)
 * Reclaim and compaction are timed begin -> end on the thread itself.
 *
 * Stacks of the waits, in wait_pending (tid -> stack), sent when the wait ends:
 *   S: taken at switch-out (per-thread rate limit), sent at wakeup as a SLEEP
 *      event; the same stack then waits for the CPU as a RUNQUEUE one.
 *   preempted: taken at switch-out (per-process rate limit) as a RUNQUEUE one.
 *   switch-in: a RUNQUEUE stack is sent weighted by the run-queue delay the
 *      thread accumulated since its last run-queue stack was sent (waits whose
 *      stack was rate limited, D wakeups, this one): the weights of a thread's
 *      run-queue stacks add up to its run-queue time, less what the last sent
 *      stack has not carried yet (runqueue_unsent_ns).
 */

static __always_inline void episode_count(__u32 which)
{
	__u64 *val = bpf_map_lookup_elem(&episode_counters, &which);

	if (val)
		*val += 1;
}

static __always_inline bool episode_watched(__u32 tgid)
{
	__u32 *flags;

	if (!tgid) /* the idle task: half of all switches on a quiet CPU */
		return false;
	flags = bpf_map_lookup_elem(&pid_filter, &tgid);

	return flags && (*flags & BISTOURI_EPISODE_FILTER_ON);
}

/* The thread's times, created (state unknown) on first sight; NULL if the map refuses. */
static __always_inline struct bistouri_thread_times *thread_entry(__u32 tgid, __u32 tid,
								  struct task_struct *task)
{
	struct bistouri_thread_times *t = bpf_map_lookup_elem(&thread_times, &tid);
	struct bistouri_thread_times fresh = { .pid = tgid, .tid = tid };

	if (t && t->pid == tgid)
		return t;
	/* New, or its tid now belongs to another process: start over. */
	BPF_CORE_READ_STR_INTO(&fresh.comm, task, comm);
	if (bpf_map_update_elem(&thread_times, &tid, &fresh, BPF_ANY)) {
		episode_count(BISTOURI_EPC_THREADS_FULL);
		return NULL;
	}
	return bpf_map_lookup_elem(&thread_times, &tid);
}

/*
 * A run-queue wait of `delay` ns ends: add it to what the thread's run-queue
 * stacks have not carried yet and, if it has one pending, send it carrying all
 * of that (blocked_ns the mean of those waits, `waits` their number). A stack
 * that cannot be sent leaves its time to the next one. Called wherever
 * runqueue_ns grows, so sent + unsent is the thread's run-queue time.
 */
static __always_inline void runqueue_done(struct bistouri_thread_times *t, __u64 delay)
{
	struct bistouri_stack_event *pending;
	__u32 tid = t->tid, waits;

	t->runqueue_unsent_ns += delay;
	t->runqueue_unsent += 1;
	pending = bpf_map_lookup_elem(&wait_pending, &tid);
	if (!pending)
		return;
	if (pending->kind == BISTOURI_EVENT_RUNQUEUE) {
		waits = t->runqueue_unsent;
		pending->waits = waits;
		pending->blocked_ns = t->runqueue_unsent_ns / (waits ? waits : 1);
		if (send_wait(pending)) {
			t->runqueue_unsent_ns -= pending->blocked_ns * waits;
			t->runqueue_unsent = 0;
			episode_count(BISTOURI_EPC_RUNQUEUE_STACKS);
		}
	}
	bpf_map_delete_elem(&wait_pending, &tid);
}

/* Close the state the thread was in at `now`: add its time where it belongs. */
static __always_inline void close_state(struct bistouri_thread_times *t, __u64 now)
{
	__u64 d = t->since_ns && now > t->since_ns ? now - t->since_ns : 0;

	switch (t->state) {
	case BISTOURI_STATE_RUNNING:
		t->on_cpu_ns += d;
		break;
	case BISTOURI_STATE_RUNNABLE:
		t->runqueue_ns += d;
		t->runqueue_waits += 1;
		runqueue_done(t, d);
		break;
	case BISTOURI_STATE_BLOCKED_D:
		t->blocked_d_ns += d;
		t->d_waits += 1;
		break;
	case BISTOURI_STATE_BLOCKED_S:
		t->blocked_s_ns += d;
		t->s_waits += 1;
		break;
	}
}

/* A pending stack (sleep or reclaim) of `tid` ends now: send it with its duration. */
static __always_inline void send_pending(void *map, __u32 tid, __u64 now)
{
	struct bistouri_stack_event *pending = bpf_map_lookup_elem(map, &tid);

	if (!pending)
		return;
	send_timed_wait(pending, now);
	bpf_map_delete_elem(map, &tid);
}

/*
 * The waits a sleep or reclaim stack taken now stands for (1 + the ones the
 * per-thread rate limit skipped since the last), or 0: at most one stack per
 * offcpu_interval_ns per thread.
 */
static __always_inline __u32 stack_due(struct bistouri_thread_times *t, __u64 now)
{
	__u32 waits;

	if (t->stack_ns && now - t->stack_ns < cfg.offcpu_interval_ns) {
		t->skipped += 1;
		episode_count(BISTOURI_EPC_STACKS_LIMITED);
		return 0;
	}
	waits = 1 + t->skipped;
	t->skipped = 0;
	t->stack_ns = now;
	return waits;
}

/*
 * Whether a run-queue stack of `tgid` is due: at most one per
 * runqueue_interval_ns per process. A CPU-bound process on a crowded machine
 * is preempted at every tick: each stack sent costs user space a decoded
 * record, and a thread preempted in between has no stack of its own, its delay
 * goes to its next one (the totals stay exact; only the stacks are fewer).
 */
static __always_inline bool runqueue_stack_due(__u32 tgid, __u64 now)
{
	__u64 *last = bpf_map_lookup_elem(&runqueue_last, &tgid);

	if (last && now - *last < cfg.runqueue_interval_ns) {
		episode_count(BISTOURI_EPC_STACKS_LIMITED);
		return false;
	}
	if (last)
		*last = now;
	else
		bpf_map_update_elem(&runqueue_last, &tgid, &now, BPF_ANY);
	return true;
}

/* The system call a thread blocked in and its first two arguments (which object, which operation). */
#if defined(__TARGET_ARCH_arm64)
#define SYSCALL_OF(regs, out)                                  \
	do {                                                   \
		(out)[0] = BPF_CORE_READ(regs, syscallno);     \
		(out)[1] = BPF_CORE_READ(regs, orig_x0);       \
		(out)[2] = BPF_CORE_READ(regs, regs[1]);       \
	} while (0)
#else
#define SYSCALL_OF(regs, out)                                  \
	do {                                                   \
		(out)[0] = BPF_CORE_READ(regs, orig_ax);       \
		(out)[1] = BPF_CORE_READ(regs, di);            \
		(out)[2] = BPF_CORE_READ(regs, si);            \
	} while (0)
#endif

/*
 * Where the current thread blocks, hashed; 0 if unknown (a kernel thread).
 * Its registers at its kernel entry: the user ip, sp and frame pointer, the
 * system call and its first two arguments; the two words at its stack pointer
 * and at its frame pointer; its address space; and the unwind tables'
 * generation (a walk made before the process's tables were in, by frame
 * pointer, is not copied once they are). A thread that sleeps where it last
 * slept (an idle JVM's threads, hundreds of times a second between them) has
 * the same one.
 */
static __always_inline __u64 blocked_at(__u64 mm, int how)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct unwind_regs user = {};
	__u64 at[13] = {}, *generation;
	struct pt_regs *regs;
	__u32 zero = 0;
	void *stack;

	if (!mm)
		return 0;
	if (how == STACK_TABLES) {
		regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
	} else {
		/* As user_regs_bounded: the pt_regs at the top of the kernel stack. */
		stack = BPF_CORE_READ(task, stack);
		if (!stack)
			return 0;
		regs = (struct pt_regs *)(stack + KERNEL_STACK_SIZE) - 1;
	}
	if (!regs || !KERNEL_REGS_USER_MODE(regs))
		return 0;
	USER_REGS_FROM_KERNEL(regs, &user);
	at[0] = user.ip;
	at[1] = user.sp;
	at[2] = user.bp;
#if defined(__TARGET_ARCH_arm64)
	at[3] = user.lr;
#endif
	at[4] = mm;
	generation = bpf_map_lookup_elem(&unwind_generation, &zero);
	at[5] = generation ? *generation : 0;
	SYSCALL_OF(regs, &at[6]);
	/* A word that cannot be read stays 0: the same on the next look. */
	bpf_probe_read_user(&at[9], 2 * sizeof(__u64), (void *)user.sp);
	if (user.bp)
		bpf_probe_read_user(&at[11], 2 * sizeof(__u64), (void *)user.bp);
	return hash_ips(at, sizeof(at)) | 1; /* never 0, "unknown" */
}

/*
 * The stacks of `ev` copied from the recorder's entry of its thread and kind
 * with the kernel and user stacks of the thread's last walk: no walk. False if
 * there is no such entry (the process was not recorded then, or the entry was
 * evicted).
 */
static __always_inline bool copy_recorded_stacks(struct bistouri_stack_event *ev, struct bistouri_thread_times *t,
						 __u64 mm)
{
	struct bistouri_recorder_key key = {
		.tid = ev->tid,
		.kind = ev->kind,
		.kernel_hash = t->stack_kernel_hash,
		.user_key = { .pid = ev->pid, .mm = mm, .hash = t->stack_user_hash },
	};
	struct bistouri_recorded_wait *w = bpf_map_lookup_elem(&recorder_waits, &key);
	struct bistouri_stack_event *old;

	if (!w)
		return false;
	old = (struct bistouri_stack_event *)w->event;
	ev->kernel_hash = key.kernel_hash;
	ev->kernel_stack_size = old->kernel_stack_size;
	bpf_probe_read_kernel(ev->kernel_stack, sizeof(ev->kernel_stack), old->kernel_stack);
	ev->user_key = key.user_key;
	ev->map_count = BPF_CORE_READ((struct mm_struct *)mm, map_count);
	ev->user_stack_size = old->user_stack_size;
	ev->user_by_table = old->user_by_table;
	ev->user_by_fp = old->user_by_fp;
	ev->user_walk_end = old->user_walk_end;
	ev->py_depth = 0;
	ev->py_status = BISTOURI_PY_STATUS_NOT_PYTHON;
	bpf_probe_read_kernel(ev->user_stack, sizeof(ev->user_stack), old->user_stack);
	episode_count(BISTOURI_EPC_STACKS_REUSED);
	return true;
}

/*
 * Take the current thread's stack into `map` (tid -> stack) for a wait of
 * `kind` starting now. A sleep where the thread's last walked sleep began
 * (blocked_at, t->stack_at) is not walked: its stacks are copied from the
 * recorder's entry of that walk, if there is one. The walks, kernel stack
 * (~12 us at sched_switch, measured) and user stack, were what an idle JVM's
 * sleeps cost. Not for Python threads (the same native registers may run
 * other Python frames), nor run-queue stacks (preempted anywhere in the
 * kernel; rate limited per process) and reclaims (rare), nor in the bounded
 * twins (5.12-5.16: each sleep walked, as before).
 */
static __always_inline void take_stack(void *ctx, struct bistouri_thread_times *t, void *map, __u32 kind,
				       __u32 waits, __u64 now, int how)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid, zero = 0;
	struct bistouri_stack_event *ev;
	__u64 mm = 0, at = 0;

	ev = bpf_map_lookup_elem(&episode_scratch, &zero);
	if (!ev)
		return;
	fill_header(ev, kind, pid_tgid, now);
	ev->waits = waits;
	/* Not in the bounded twins: with it, 6.1's verifier went past its 1 M instructions on
	 * handle_episode_switch_bounded (628 k without). */
	if (kind == BISTOURI_EVENT_SLEEP && how != STACK_BOUNDED) {
		mm = (__u64)BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), mm);
		at = blocked_at(mm, how);
	}
	if (!at || at != t->stack_at || !copy_recorded_stacks(ev, t, mm)) {
		fill_stacks(ctx, ev, cfg.tp_btf_skip, NULL, how);
		if (kind == BISTOURI_EVENT_SLEEP && how != STACK_BOUNDED) {
			t->stack_at = ev->py_status == BISTOURI_PY_STATUS_NOT_PYTHON ? at : 0;
			t->stack_kernel_hash = ev->kernel_hash;
			t->stack_user_hash = ev->user_key.hash;
		}
	}
	ev->timestamp_ns = bpf_ktime_get_ns(); /* the wait starts now: the walk above is ours */
	if (bpf_map_update_elem(map, &tid, ev, BPF_ANY))
		report_error(BISTOURI_CNT_OFFCPU_PENDING_FULL, ev->pid, 0);
}

/* A sleep of `tid` ends (woken at `now`): send its stack, which then waits for a CPU. */
static __always_inline void sleep_woken(__u32 tid, __u64 now)
{
	struct bistouri_stack_event *pending = bpf_map_lookup_elem(&wait_pending, &tid);

	if (!pending || pending->kind != BISTOURI_EVENT_SLEEP)
		return;
	send_timed_wait(pending, now);
	pending->kind = BISTOURI_EVENT_RUNQUEUE;
	pending->timestamp_ns = now;
	pending->waits = 1;
}

static __always_inline void episode_wakeup(struct task_struct *p, bool new_task)
{
	__u32 tgid = BPF_CORE_READ(p, tgid), tid;
	struct bistouri_thread_times *t;
	__u64 now;

	if (!episode_watched(tgid))
		return;
	now = bpf_ktime_get_ns();
	tid = BPF_CORE_READ(p, pid);
	t = thread_entry(tgid, tid, p);
	if (!t)
		return;
	if (t->state == BISTOURI_STATE_RUNNING || t->state == BISTOURI_STATE_RUNNABLE)
		return; /* already counted as wanting a CPU */
	episode_count(BISTOURI_EPC_WAKEUPS);
	if (t->state == BISTOURI_STATE_BLOCKED_S)
		sleep_woken(tid, now);
	if (t->state != BISTOURI_STATE_UNKNOWN && !new_task)
		close_state(t, now);
	t->state = BISTOURI_STATE_RUNNABLE;
	t->since_ns = now;
}

/* Reclaim and compaction run on the stalled thread itself: current. */
static __always_inline void reclaim_begin(void *ctx, int how)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct bistouri_thread_times *t;
	__u32 waits;
	__u64 now;

	if (!episode_watched(tgid))
		return;
	t = thread_entry(tgid, tid, (struct task_struct *)bpf_get_current_task());
	if (!t || t->reclaim_start_ns)
		return; /* nested (compaction inside reclaim): the outer one is timed */
	now = bpf_ktime_get_ns();
	t->reclaim_start_ns = now;
	waits = stack_due(t, now);
	if (waits)
		take_stack(ctx, t, &reclaim_pending, BISTOURI_EVENT_RECLAIM, waits, now, how);
}

static __always_inline void reclaim_end(void)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct bistouri_thread_times *t;
	__u64 now;

	if (!episode_watched(tgid))
		return;
	t = bpf_map_lookup_elem(&thread_times, &tid);
	if (!t || !t->reclaim_start_ns)
		return;
	now = bpf_ktime_get_ns();
	t->reclaim_ns += now - t->reclaim_start_ns;
	t->reclaims += 1;
	t->reclaim_start_ns = 0;
	episode_count(BISTOURI_EPC_RECLAIMS);
	send_pending(&reclaim_pending, tid, now);
}
#endif /* BISTOURI_EPISODE_BPF_H */
