/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * A stack event from its header to the ring: the kernel stack
 * (bpf_get_stack), the user stack (walk_user from unwind.bpf.h, or the
 * kernel's frame-pointer walk), the Python frames of a CPython process
 * (walk_python from python.bpf.h), the hashes user space keys repeats by, and
 * emit_stack(), the one way a finished event goes to stack_events. Used by
 * every program that takes a stack: on-CPU samples, off-CPU waits and the
 * episode hooks.
 */
#ifndef BISTOURI_STACK_BPF_H
#define BISTOURI_STACK_BPF_H

#define KERNEL_STACK_BYTES (BISTOURI_MAX_DEPTH * sizeof(__u64))

/* FNV-1a over the first `bytes` of a stack of IPs (up to BISTOURI_MAX_DEPTH of them). */
static __always_inline __u64 hash_ips(const __u64 *ips, long bytes)
{
	__u64 h = 0xcbf29ce484222325ULL;

	for (int i = 0; i < BISTOURI_MAX_DEPTH; i++) {
		if ((long)(i * sizeof(__u64)) >= bytes) /* signed: a negative size (error) hashes nothing */
			break;
		h = (h ^ ips[i]) * 0x100000001b3ULL;
	}
	return h;
}

#if defined(__TARGET_ARCH_arm64)
/*
 * pstate is word 33 of the UAPI struct user_pt_regs (arch/arm64/include/uapi/asm/ptrace.h:
 * regs[31] sp pc pstate), and its mode bits (PSR_MODE_MASK) are 0 in user mode (EL0t).
 * Both the perf context's registers and the kernel's pt_regs begin with that layout.
 */
#define PT_REGS_MODE_WORD 33
#define PSR_MODE_MASK 0xf
#define PSR_MODE_EL0T 0
#define REG_FP 29 /* x29, the frame pointer */
#define REG_LR 30 /* x30, the link register */
/* x29, x30, sp and pc by word too, for the program that reads no kernel type. */
#define PT_REGS_BP_WORD REG_FP
#define PT_REGS_LR_WORD REG_LR
#define PT_REGS_SP_WORD 31
#define PT_REGS_IP_WORD 32

static __always_inline bool user_mode_word(__u64 pstate)
{
	return (pstate & PSR_MODE_MASK) == PSR_MODE_EL0T;
}

/* The walk's registers from the perf context's (bpf_user_pt_regs_t is struct user_pt_regs). */
#define USER_REGS_FROM_CTX(ctx, out)                   \
	do {                                           \
		(out)->ip = (ctx)->regs.pc;            \
		(out)->sp = (ctx)->regs.sp;            \
		(out)->bp = (ctx)->regs.regs[REG_FP];  \
		(out)->lr = (ctx)->regs.regs[REG_LR];  \
	} while (0)
/* The same from a kernel struct pt_regs, field by field (CO-RE probe reads). */
#define USER_REGS_FROM_KERNEL(regs, out)                               \
	do {                                                           \
		(out)->ip = BPF_CORE_READ(regs, pc);                   \
		(out)->sp = BPF_CORE_READ(regs, sp);                   \
		(out)->bp = BPF_CORE_READ(regs, regs[REG_FP]);         \
		(out)->lr = BPF_CORE_READ(regs, regs[REG_LR]);         \
	} while (0)
#define KERNEL_REGS_USER_MODE(regs) user_mode_word(BPF_CORE_READ(regs, pstate))
#else
/*
 * cs is word 17 of the UAPI struct pt_regs (arch/x86/include/uapi/asm/ptrace.h:
 * r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags
 * rsp ss), and the low two bits of a segment selector are its privilege level: 3 is
 * user mode. rbp, rip and rsp by word too, for the program that reads no kernel type.
 */
#define PT_REGS_MODE_WORD 17
#define PT_REGS_BP_WORD 4
#define PT_REGS_IP_WORD 16
#define PT_REGS_SP_WORD 19
#define SELECTOR_RPL_MASK 3
#define USER_RPL 3

static __always_inline bool user_mode_word(__u64 cs)
{
	return (cs & SELECTOR_RPL_MASK) == USER_RPL;
}

#define USER_REGS_FROM_CTX(ctx, out)           \
	do {                                   \
		(out)->ip = (ctx)->regs.ip;    \
		(out)->sp = (ctx)->regs.sp;    \
		(out)->bp = (ctx)->regs.bp;    \
	} while (0)
#define USER_REGS_FROM_KERNEL(regs, out)               \
	do {                                           \
		(out)->ip = BPF_CORE_READ(regs, ip);   \
		(out)->sp = BPF_CORE_READ(regs, sp);   \
		(out)->bp = BPF_CORE_READ(regs, bp);   \
	} while (0)
#define KERNEL_REGS_USER_MODE(regs) user_mode_word(BPF_CORE_READ(regs, cs))
#endif

/* Whether a perf sample interrupted user mode (pt_regs.cs, pstate on aarch64); false without one. */
static __always_inline bool in_user_mode(struct bpf_perf_event_data *ctx)
{
	/* regs is the UAPI pt_regs at the context's start: a plain offset, not a CO-RE relocation. */
	return ctx && user_mode_word(((const __u64 *)ctx)[PT_REGS_MODE_WORD]);
}

/* The user registers of the current task: at the interrupt if it hit user mode, else at its kernel entry. */
static __always_inline bool user_regs_of(struct bpf_perf_event_data *ctx, struct unwind_regs *out)
{
	struct pt_regs *regs;

	if (in_user_mode(ctx)) {
		USER_REGS_FROM_CTX(ctx, out);
		return true;
	}
	regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
	if (!regs)
		return false;
	USER_REGS_FROM_KERNEL(regs, out);
	return true;
}

/*
 * The kernel stack size (THREAD_SIZE, 16 KiB on x86-64 and arm64; 32 KiB under
 * KASAN) and the user registers at its top (task_pt_regs(): no padding on either).
 */
#define KERNEL_STACK_SIZE (16 << 10)

/*
 * The user registers of the current task without bpf_task_pt_regs (< 5.15):
 * at the interrupt if it hit user mode, else the pt_regs its kernel entry
 * saved at the top of its kernel stack, taken only if they are user mode's.
 */
static __always_inline bool user_regs_bounded(struct bpf_perf_event_data *ctx, struct unwind_regs *out)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct pt_regs *regs;
	void *stack;

	if (in_user_mode(ctx)) {
		USER_REGS_FROM_CTX(ctx, out);
		return true;
	}
	/* Field by field (probe reads): a struct copied whole let clang merge it with the ctx path above. */
	stack = BPF_CORE_READ(task, stack);
	if (!stack)
		return false;
	regs = (struct pt_regs *)(stack + KERNEL_STACK_SIZE) - 1;
	if (!KERNEL_REGS_USER_MODE(regs))
		return false;
	USER_REGS_FROM_KERNEL(regs, out);
	return true;
}

/*
 * How a program takes the user stack, a constant of each program (its code is
 * inlined once per value); bistouri/bpf/features.py chooses the programs:
 *   STACK_TABLES   walk_user (.eh_frame tables, frame pointers elsewhere) and
 *                  the Python frames: needs bpf_loop (5.17), bpf_task_pt_regs
 *                  (5.15) and global functions taking pointers (5.12);
 *   STACK_BOUNDED  the same walks as bounded loops, BOUNDED_DEPTH native and
 *                  PY_BOUNDED_STEPS Python frames, the registers of a thread
 *                  in the kernel read from its kernel stack: the *_bounded
 *                  programs, for 5.12 to 5.16;
 *   STACK_FP       the kernel's frame-pointer walk, the address space read as
 *                  above: the *_compat programs, for 5.10 and 5.11, which cut a
 *                  stack short at the first frameless function and take no
 *                  Python frame;
 *   STACK_FP_BARE  the same walk, no kernel struct read (no CO-RE relocation):
 *                  record's first sampler, handle_perf_fp.
 */
/* fill_stacks' py_status until the Python walk has run or been skipped: never sent. */
#define PY_STATUS_UNKNOWN 0xff

#define STACK_TABLES 0
#define STACK_FP 1
#define STACK_FP_BARE 2
#define STACK_BOUNDED 3

static __always_inline void fill_stacks(void *ctx, struct bistouri_stack_event *ev,
					__u32 kernel_skip, struct bpf_perf_event_data *perf_ctx, int how)
{
	struct unwind_regs regs = {};
	struct bistouri_user_stack_key *key = &ev->user_key;
	struct mm_struct *mm = NULL;
	long n;

	/* A sample that hit user mode has no kernel stack: the helper would only say so. */
	if (in_user_mode(perf_ctx))
		n = 0;
	else
		n = bpf_get_stack(ctx, ev->kernel_stack, KERNEL_STACK_BYTES, kernel_skip & BPF_F_SKIP_FIELD_MASK);
	ev->kernel_stack_size = n;
	if (n < 0)
		report_error(BISTOURI_CNT_KERNEL_STACK_ERROR, ev->pid, n);
	ev->kernel_hash = hash_ips(ev->kernel_stack, n);

	/*
	 * Raw IPs only: the build-id walk (BPF_F_USER_BUILD_ID) cost ~8 us a new
	 * stack and fell back to bare IPs whenever the mmap lock was busy. User
	 * space maps the IPs to files from /proc/PID/maps instead.
	 */
	key->pid = ev->pid;
	key->reserved = 0;
	key->hash = 0;
	ev->user_by_table = 0;
	ev->user_by_fp = 0;
	ev->user_walk_end = 0;
	/* walk_user sets NOT_PYTHON when its unwind_procs entry says so; otherwise python_procs decides. */
	ev->py_depth = 0;
	ev->py_status = PY_STATUS_UNKNOWN;
	if (how == STACK_FP_BARE) {
		/*
		 * No kernel struct read, so no CO-RE relocation: record loads this program
		 * without the kernel's BTF, which libbpf takes ~11 ms to parse. The address
		 * space and its mapping count stay 0 (unknown to user space).
		 */
		key->mm = 0;
		ev->map_count = 0;
	} else {
		mm = BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), mm);
		key->mm = (__u64)mm;
		ev->map_count = mm ? BPF_CORE_READ(mm, map_count) : 0;
	}
	if (how == STACK_TABLES) {
		/* Kernel threads have no user stack: not an error. */
		n = mm && user_regs_of(perf_ctx, &regs) ? walk_user(ev, &regs, perf_ctx ? 0 : 1, false) : 0;
	} else if (how == STACK_BOUNDED) {
		n = mm && user_regs_bounded(perf_ctx, &regs) ? walk_user(ev, &regs, perf_ctx ? 0 : 1, true) : 0;
	} else {
		/* The kernel finds the user registers itself (task_pt_regs), on-CPU or off. */
		n = bpf_get_stack(ctx, ev->user_stack, sizeof(ev->user_stack), BPF_F_USER_STACK);
		if (n < 0) {
			report_error(BISTOURI_CNT_USER_STACK_ERROR, ev->pid, n);
			n = 0;
		}
		/* Each frame past the first was found by frame pointer; why the walk ended is unknown (0). */
		ev->user_by_fp = n > (long)sizeof(__u64) ? n / sizeof(__u64) - 1 : 0;
	}
	ev->user_stack_size = n;
	if (n > 0)
		key->hash = hash_ips(ev->user_stack, n);
	/* In the ev, not a local: handle_perf -> walk_python -> py_step has no stack to spare. */
	if (how == STACK_TABLES && ev->py_status == BISTOURI_PY_STATUS_NOT_PYTHON)
		return;
	if (how == STACK_TABLES)
		walk_python(ev, perf_ctx ? 0 : 1);
	else if (how == STACK_BOUNDED)
		walk_python_bounded(ev, perf_ctx ? 0 : 1);
	else
		ev->py_status = BISTOURI_PY_STATUS_NOT_PYTHON;
}

static __always_inline void fill_header(struct bistouri_stack_event *ev, __u32 kind,
					__u64 pid_tgid, __u64 now)
{
	ev->kind = kind;
	ev->pid = pid_tgid >> 32;
	ev->tid = (__u32)pid_tgid;
	ev->cpu = bpf_get_smp_processor_id();
	ev->timestamp_ns = now;
	ev->blocked_ns = 0;
	ev->waits = 1;
	bpf_get_current_comm(ev->comm, sizeof(ev->comm));
}

/*
 * Whether the sampled process's mappings changed since its last sample; if so,
 * also whether to wake the reader now (at most every MAP_WAKEUP_INTERVAL_NS).
 */
static __always_inline bool maps_changed(struct bistouri_stack_event *ev, bool *wake)
{
	struct map_seen *seen = bpf_map_lookup_elem(&map_counts, &ev->pid);
	struct map_seen fresh = { .count = ev->map_count, .woke_ns = ev->timestamp_ns };

	*wake = false;
	if (!seen) {
		/* Its first sample: the maps user space read may be older than this. */
		bpf_map_update_elem(&map_counts, &ev->pid, &fresh, BPF_ANY);
		*wake = true;
		count(BISTOURI_CNT_MAP_CHANGES);
		return true;
	}
	if (seen->count == ev->map_count)
		return false;
	seen->count = ev->map_count;
	if (ev->timestamp_ns - seen->woke_ns >= MAP_WAKEUP_INTERVAL_NS) {
		seen->woke_ns = ev->timestamp_ns;
		*wake = true;
	}
	count(BISTOURI_CNT_MAP_CHANGES);
	return true;
}


/* Send a finished stack event; a full ring is counted and reported. Returns whether it went. */
static __always_inline bool emit_stack(struct bistouri_stack_event *ev, __u64 flags)
{
	/* Up to the Python frames taken: most events have none, and go 1 KiB shorter. */
	__u32 depth = ev->py_depth;
	__u64 size;

	if (depth > BISTOURI_PY_MAX_DEPTH)
		depth = BISTOURI_PY_MAX_DEPTH;
	size = __builtin_offsetof(struct bistouri_stack_event, py_frames) + depth * sizeof(struct bistouri_py_frame);
	if (bpf_ringbuf_output(&stack_events, ev, size, flags)) {
		report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, ev->pid, 0);
		return false;
	}
	return true;
}

/*
 * ---- Raw stack copies (BISTOURI_FILTER_RAW_STACK) ----
 * A sample whose user walk was cut short while its process asked for copies
 * (record, until its tables are published) goes to raw_stacks instead of
 * stack_events: the walk's registers, the event as walked, and the top
 * BISTOURI_RAW_STACK_BYTES of the user stack, walked again by user space once
 * the tables are in (bistouri/capture/rawstacks.py).
 */

/* Whether the user walk of a sample was cut short: not at the entry, not at the depth limit. */
static __always_inline bool walk_cut_short(struct bistouri_stack_event *ev, int how)
{
	if (how == STACK_FP_BARE) /* the kernel's walk says nothing of how it ended */
		return ev->user_stack_size >= 0;
	return ev->user_walk_end != BISTOURI_CNT_WALK_END && ev->user_walk_end != BISTOURI_CNT_WALK_DEPTH;
}

/* The user registers of an on-CPU sample, as `how` finds them; the bare program has only the interrupt's. */
static __always_inline bool raw_stack_regs(struct bpf_perf_event_data *ctx, int how, struct unwind_regs *regs)
{
	if (how == STACK_TABLES)
		return user_regs_of(ctx, regs);
	if (how == STACK_BOUNDED)
		return user_regs_bounded(ctx, regs);
	if (how == STACK_FP_BARE && in_user_mode(ctx)) {
		/* Plain offsets, as in_user_mode(): ctx->regs would be a CO-RE relocation (the kernel's BTF). */
		regs->ip = ((const __u64 *)ctx)[PT_REGS_IP_WORD];
		regs->sp = ((const __u64 *)ctx)[PT_REGS_SP_WORD];
		regs->bp = ((const __u64 *)ctx)[PT_REGS_BP_WORD];
#if defined(__TARGET_ARCH_arm64)
		regs->lr = ((const __u64 *)ctx)[PT_REGS_LR_WORD];
#endif
		return true;
	}
	return false;
}

/*
 * The user stack from sp up, a page at a time (a read may not cross into a page
 * that is not there): the copy ends at the first page that cannot be read (the
 * stack's top). RAW_STACK_PAGES reads cover BISTOURI_RAW_STACK_BYTES from any
 * sp. Returns the bytes copied.
 */
static __always_inline __u32 copy_user_stack(struct bistouri_raw_stack *raw, __u64 sp)
{
	__u64 at = sp, size;
	__u32 off = 0;

	for (int i = 0; i < RAW_STACK_PAGES; i++) {
		size = RAW_STACK_PAGE - (at & (RAW_STACK_PAGE - 1));
		if (size > BISTOURI_RAW_STACK_BYTES - off)
			size = BISTOURI_RAW_STACK_BYTES - off;
		if (!size)
			break;
		/*
		 * 1..RAW_STACK_PAGE again, in a form 5.10's verifier bounds: it loses the min()
		 * above (size up to 16 KiB, refused), and clang must not drop the mask.
		 */
		barrier_var(size);
		size = ((size - 1) & (RAW_STACK_PAGE - 1)) + 1;
		/* Masked: a page read at any offset below the end stays in raw_scratch (its room). */
		if (bpf_probe_read_user(&raw->stack[off & (BISTOURI_RAW_STACK_BYTES - 1)], size, (void *)at))
			break;
		off += size;
		at += size;
	}
	return off;
}

/* Send the sample as a raw copy; false (the caller sends it as walked) without registers or room. */
static __always_inline bool emit_raw_stack(struct bpf_perf_event_data *ctx, struct bistouri_stack_event *ev,
					   int how, bool wake)
{
	struct unwind_regs regs = {};
	struct bistouri_raw_stack *raw;
	struct raw_scratch *s;
	__u32 zero = 0, n;
	__u64 flags = BPF_RB_NO_WAKEUP;

	if (!raw_stack_regs(ctx, how, &regs) || !regs.sp || regs.ip > USER_TOP)
		return false;
	s = bpf_map_lookup_elem(&raw_scratch, &zero);
	if (!s)
		return false;
	raw = &s->raw;
	raw->ip = regs.ip;
	raw->sp = regs.sp;
	raw->bp = regs.bp;
#if defined(__TARGET_ARCH_arm64)
	raw->lr = regs.lr;
#else
	raw->lr = 0;
#endif
	raw->reserved = 0;
	/* One helper call copies the event (~3 KiB) where the record needs it. */
	if (bpf_probe_read_kernel(&raw->event, sizeof(raw->event), ev))
		return false;
	n = copy_user_stack(raw, regs.sp);
	barrier_var(n); /* the bound below is the verifier's, not clang's to drop */
	if (n > BISTOURI_RAW_STACK_BYTES)
		n = BISTOURI_RAW_STACK_BYTES;
	raw->stack_size = n;
	/* Woken as stack_events is: at once for a process's first sample, else past a quarter of the ring. */
	if (wake || bpf_ringbuf_query(&raw_stacks, BPF_RB_AVAIL_DATA) >= bpf_ringbuf_query(&raw_stacks, BPF_RB_RING_SIZE) / 4)
		flags = BPF_RB_FORCE_WAKEUP;
	if (bpf_ringbuf_output(&raw_stacks, raw, __builtin_offsetof(struct bistouri_raw_stack, stack) + n, flags)) {
		count(BISTOURI_CNT_RAW_STACK_LOST);
		return false;
	}
	count(BISTOURI_CNT_RAW_STACKS);
	return true;
}

#endif /* BISTOURI_STACK_BPF_H */
